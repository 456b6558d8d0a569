"""``gpu_memory_utilization``: the KV cache's budget from a share of the device's total memory (device-free).

vLLM's meaning: the engine may use ``utilization * total`` bytes in all. The weights take their
share, a step's activations take their peak, and the KV cache gets the rest. The weights' bytes come
from config.json's sizes; the activations' peak is estimated from the step's limits
(:func:`activation_peak_bytes`), before anything is allocated, so a share that cannot hold the model
is refused at once, and so is one that the memory free now cannot give (other processes hold the rest).
"""

from __future__ import annotations

from typing import Any

__all__ = ["activation_peak_bytes", "memory_utilization_budget"]

#: Bytes per vocabulary entry of a sampled row: float32 logits, the sampler's float32 working copy
#: and its int64 sort indices.
_SAMPLED_ROW_BYTES = 4 + 4 + 8


def activation_peak_bytes(config: Any, itemsize: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """An upper estimate of one step's live activations: ``max_num_batched_tokens`` tokens through the widest
    layer at once (the residual stream and its norm, q/k/v, the MLP's gate and up projections, the
    attention output), plus the logits and the sampler's buffers for up to ``max_num_seqs`` rows.

    :param config: a ``vllm_port.models.ModelConfig`` or an imported model's config (``hidden_size``,
        ``num_heads``, ``num_kv_heads``, ``head_size``, ``vocab_size``; ``intermediate_size``, taken
        as 4 × ``hidden_size`` where the config does not say, as an imported model's does not).
    :param itemsize: bytes per element of the model's dtype.
    """
    c = config
    q, kv = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    mlp = getattr(c, "intermediate_size", 4 * c.hidden_size)
    per_token = (3 * c.hidden_size + q + 2 * kv + 2 * mlp) * itemsize
    rows = min(max_num_seqs, max_num_batched_tokens)
    return max_num_batched_tokens * per_token + rows * c.vocab_size * _SAMPLED_ROW_BYTES


def _gib(n: int | float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def memory_utilization_budget(
    utilization: float, free: int, total: int, weights: int, activations: int, where: str
) -> int:
    """The KV cache's bytes when the engine may use ``utilization`` of ``total``: what the weights and the
    activations' peak leave of that share.

    :param free: bytes free now (before the weights load); the share must not take more than that.
    :param where: the memory's name for the messages (``"platform 'cuda''s device"``, ``"host memory"``).
    :raises ValueError: when nothing is left for the cache, or the share exceeds what is free now;
        the message names ``gpu_memory_utilization``, the bytes, and the value that would work.
    """
    allowed = int(total * utilization)
    kv = allowed - weights - activations
    if kv <= 0:
        needed = (weights + activations) / total
        raise ValueError(
            f"gpu_memory_utilization={utilization}: {_gib(allowed)} of {where}'s {_gib(total)} leaves nothing for the "
            f"KV cache after the weights ({_gib(weights)}) and the activations' peak (~{_gib(activations)}); raise it "
            f"above {needed:.3f}, or lower max_num_batched_tokens/max_num_seqs"
        )
    if weights + activations + kv > free:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {_gib(allowed)} of {where}'s {_gib(total)}, but only "
            f"{_gib(free)} is free now (other processes hold the rest); lower it to at most {free / total:.3f}"
        )
    return kv
