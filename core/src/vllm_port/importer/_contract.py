"""What rewritten graphs call: one small function per contract op, with the bound ops as first argument.

A rewritten piece (``_rewrite``) calls these instead of the aten nodes they replace, passing the
graph's ``ops`` input, so one rewritten graph runs with any binding: eagerly, under
``vllm_port.flat.trace`` (each call becomes one contract node) and under ``torch.compile``. Each
function adapts transformers' layouts (``[1, tokens, ...]``, heads before tokens) to the kernels'
(tokens first, flattened) and back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..models.llama import DecodeRowsFirst, decode_rows_first, paged_attention_step

__all__ = [
    "CONTRACT_CALLS",
    "ROW_VIEWS",
    "contract_attention",
    "contract_embedding",
    "contract_gated",
    "contract_linear",
    "contract_rms_norm",
    "contract_rotary",
    "contract_rotary_rows",
    "from_rows",
    "split_once",
    "to_rows",
]


@dataclass(frozen=True)
class SplitOnce:
    """A step's attention metadata with its decode rows' split (:func:`decode_rows_first`) taken once for all
    layers: what ``ImportedModel.forward`` hands its layer graphs in place of the metadata itself."""

    meta: Any
    split: DecodeRowsFirst | None


def split_once(meta: Any) -> SplitOnce:
    """``meta`` with its split taken now: the core model takes it once a step, and so do imported layers."""
    return SplitOnce(meta, decode_rows_first(meta))


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows ``[tokens, features]`` (leading dimensions flattened); a 2-D ``x`` itself, with no view."""
    return x if x.dim() == 2 else x.flatten(0, -2)


def from_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows ``[tokens, features]`` viewed with the leading dimensions of ``like``; ``rows`` itself when ``like`` is 2-D.

    Skipping the identity view matters: the flat graph then reads a kernel's output directly, which
    is what the fusion passes match (``fused_add_rms_norm`` overwrites a fresh output, never a view).
    """
    return rows if like.dim() == 2 else rows.view(*like.shape[:-1], rows.shape[-1])


def contract_embedding(ops: Any, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``embedding`` over ids of any shape."""
    out = ops.embedding(input_ids.reshape(-1), weight)
    return out if input_ids.dim() == 1 else out.view(*input_ids.shape, weight.shape[1])


def contract_rms_norm(ops: Any, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``rms_norm`` over the last dimension of ``x`` (leading dimensions flattened for the kernel)."""
    return from_rows(ops.rms_norm(to_rows(x), weight, epsilon), x)


def contract_linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over the last dimension of ``x``."""
    return from_rows(ops.linear(to_rows(x), weight, bias), x)


def contract_gated(ops: Any, gate_up: torch.Tensor, activation: str, approximate: str) -> torch.Tensor:
    """``silu_and_mul`` (or ``gelu_and_mul``) of a projection holding the gate then the up half."""
    flat = to_rows(gate_up)
    out = ops.silu_and_mul(flat) if activation == "silu" else ops.gelu_and_mul(flat, approximate)
    return from_rows(out, gate_up)


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


def contract_rotary_rows(
    ops: Any,
    positions: torch.Tensor,
    query_rows: torch.Tensor,
    key_rows: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` in place on rows ``[tokens, heads * head_size]``; returns ``query`` and ``key``, views
    of those rows by heads (``[1, heads, tokens, head_size]``), which now read the rotated values.

    The op gets the rows themselves, as a core model passes the pieces of its q/k/v projection, so the
    flat graph shows the cache write's key as a view of the very tensor the rotary wrote.
    """
    ops.rotary_embedding(positions, query_rows, key_rows, query.shape[-1], cos_sin_cache, True)
    return query, key


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
    # squeeze, not flatten(0, 1): the batch is one packed sequence, and a flatten over a symbolic token count
    # traces a size read of the key, which CUDA's rotary/cache-write fusion takes for a non-view read
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    # the step's leading decode rows apart from its prefill chunks, as the core model serves them: the split's
    # offsets are one subtraction on the device, taken once a step by ImportedModel.forward (split_once)
    meta, split = (meta.meta, meta.split) if isinstance(meta, SplitOnce) else (meta, decode_rows_first(meta))
    out = paged_attention_step(ops, q, k, v, (key_cache, value_cache), meta, scale, sliding_window, soft_cap, split)
    return out[None]


#: The layout calls rewritten graphs make besides the contract calls: views, counted as such in the report.
ROW_VIEWS = (to_rows, from_rows)

#: Each call function -> the contract ops it runs (for the report and ``finish``).
CONTRACT_CALLS: dict[Callable[..., Any], tuple[str, ...]] = {
    contract_embedding: ("embedding",),
    contract_rms_norm: ("rms_norm",),
    contract_linear: ("linear",),
    contract_gated: ("silu_and_mul",),
    contract_rotary: ("rotary_embedding",),
    contract_rotary_rows: ("rotary_embedding",),
    contract_attention: ("reshape_and_cache", "paged_attention|prefill_attention"),
}
