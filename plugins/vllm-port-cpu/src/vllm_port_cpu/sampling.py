"""CPU provider of ``sample``: greedy, temperature, top-k and top-p for the whole batch at once.

Branch-free: whether any row uses top-k or top-p lives in tensors, and reading it would be a host
read, so every row goes through the same sort. The noise is the contract's shared
:func:`~vllm_port.ops.sampling.gumbel_noise`, and the arithmetic before the argmax is the
reference's (scores divided in float32), so the same seeds draw the same tokens as the reference:
a bitwise sampler, the default equivalence conformance holds it to.
"""

from __future__ import annotations

import torch

from vllm_port.ops import provider
from vllm_port.ops.sampling import check_sample, gumbel_noise

__all__ = ["sample"]


@provider("sample", name="cpu_sample", priority=10)
def sample(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    vocab = logits.shape[1]
    sampled = temperature > 0
    scores = logits.float() / torch.where(sampled, temperature, 1.0)[:, None]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp_(max=vocab)
    drop = rank >= k[:, None]  # outside the top k
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # the mass before this token already reaches top_p
    drop[:, 0] = False  # the most likely token always stays
    # back to vocabulary order as a mask (one byte a token), then the Gumbel-max draw
    dropped = torch.empty_like(drop).scatter_(1, order, drop)
    noisy = scores.masked_fill_(dropped, float("-inf")).add_(gumbel_noise(seeds, vocab))
    return torch.where(sampled, noisy.argmax(dim=-1), logits.argmax(dim=-1))
