"""What rewritten graphs call: one small function per contract op, with the bound ops as first argument.

A rewritten piece (``_rewrite``) calls these instead of the aten nodes they replace, passing the
graph's ``ops`` input, so one rewritten graph runs with any binding: eagerly, under
``vllm_port.flat.trace`` (each call becomes one contract node) and under ``torch.compile``. Each
function adapts transformers' layouts (``[1, tokens, ...]``, heads before tokens) to the kernels'
(tokens first, flattened) and back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..models.llama import paged_attention_step

__all__ = [
    "CONTRACT_CALLS",
    "contract_attention",
    "contract_embedding",
    "contract_gated",
    "contract_linear",
    "contract_rms_norm",
    "contract_rotary",
]


def contract_embedding(ops: Any, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``embedding`` over ids of any shape."""
    return ops.embedding(input_ids.reshape(-1), weight).view(*input_ids.shape, weight.shape[1])


def contract_rms_norm(ops: Any, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``rms_norm`` over the last dimension of ``x`` (leading dimensions flattened for the kernel)."""
    return ops.rms_norm(x.flatten(0, -2), weight, epsilon).view(x.shape)


def contract_linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over the last dimension of ``x``."""
    return ops.linear(x.flatten(0, -2), weight, bias).view(*x.shape[:-1], weight.shape[0])


def contract_gated(ops: Any, gate_up: torch.Tensor, activation: str, approximate: str) -> torch.Tensor:
    """``silu_and_mul`` (or ``gelu_and_mul``) of a projection holding the gate then the up half."""
    flat = gate_up.flatten(0, -2)
    out = ops.silu_and_mul(flat) if activation == "silu" else ops.gelu_and_mul(flat, approximate)
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def contract_rotary(
    ops: Any,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    heads_dim: int,
    copy_query: bool,
    copy_key: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` of ``query`` and ``key`` (``[1, ..., head_size]``, heads at ``heads_dim``).

    The op rotates in place through ``[tokens, heads, head_size]`` views; a tensor whose storage
    something else still reads is copied first (``copy_*``, decided from the graph).
    """

    def tokens_first(x: torch.Tensor, copy: bool) -> torch.Tensor:
        t = x.movedim(heads_dim, -2).flatten(0, -3)
        return t.clone() if copy else t

    q, k = tokens_first(query, copy_query), tokens_first(key, copy_key)
    ops.rotary_embedding(positions, q, k, q.shape[-1], cos_sin_cache, True)

    def back(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.view(*like.movedim(heads_dim, -2).shape).movedim(-2, heads_dim)

    return back(q, query), back(k, key)


def contract_attention(
    ops: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: Any,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Attention with the paged KV cache: the step's keys and values written, then decode or prefill attention.

    Takes transformers' attention-function layout (``[1, heads, tokens, head_size]``) and returns
    its output layout (``[1, tokens, heads, head_size]``).
    """
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
    return paged_attention_step(ops, q, k, v, (key_cache, value_cache), meta, scale, sliding_window, soft_cap)[None]


#: Each call function -> the contract ops it runs (for the report and ``finish``).
CONTRACT_CALLS: dict[Callable[..., Any], tuple[str, ...]] = {
    contract_embedding: ("embedding",),
    contract_rms_norm: ("rms_norm",),
    contract_linear: ("linear",),
    contract_gated: ("silu_and_mul",),
    contract_rotary: ("rotary_embedding",),
    contract_attention: ("reshape_and_cache", "paged_attention|prefill_attention"),
}
