# ruff: noqa: N803 - Triton's constexpr parameters are upper case
"""The CUDA plugin's own fusion: rotary embedding and the KV-cache write of the same tokens in one kernel.

A Llama layer rotates its query and key in place (``rotary_embedding``) and then writes key and
value into the paged cache (``reshape_and_cache``): two launches, and the key is read twice. The
pass :func:`fuse_rotary_and_cache` (offered through the ``vllm_port_graph_passes`` hook) replaces
the pair with ``vllm_port_cuda::rotary_embedding_and_cache``, one Triton program per (token, block
of heads) that loads each head's row once, rotates query and key in registers, stores them back
and stores the rotated key and the value into the token's cache slot (slot -1: no cache write).
It fires only where both ops are bound to this plugin's Triton providers, so a user who forces
another provider (``VLLM_PORT_OP_PROVIDERS``) gets exactly that provider.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import triton
import triton.language as tl

from vllm_port.flat import contract_op, contract_provider
from vllm_port.graph_pass import GraphPass, PassContext
from vllm_port.kernels.triton.launch import cached_launch, cdiv, next_power_of_2
from vllm_port.ops.attention import check_reshape_and_cache
from vllm_port.ops.rotary import check_rotary_embedding

__all__ = ["fuse_rotary_and_cache", "graph_passes", "rotary_embedding_and_cache"]

#: Elements (heads x head features) of one tensor a program covers at most.
_MAX_PROGRAM_ELEMENTS = 4096


@triton.jit
def _rotate_rows(rows, heads, n_heads, head_stride, elem_stride, d, d_ok, pair, sign, cos, sin, rot):
    """Load ``[HEAD_BLOCK, D_BLOCK]`` rows of one token and return them rotated (float32) and their mask."""
    mask = (heads < n_heads)[:, None] & d_ok[None, :]
    ptrs = rows + heads[:, None] * head_stride
    x = tl.load(ptrs + d[None, :] * elem_stride, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptrs + pair[None, :] * elem_stride, mask=mask & rot[None, :], other=0.0).to(tl.float32)
    rotated = x * cos[None, :] + sign[None, :] * partner * sin[None, :]
    return tl.where(rot[None, :], rotated, x), mask


@cached_launch
@triton.jit
def _rotary_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    pos_ptr,
    cos_sin_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    n_q_heads,
    n_kv_heads,
    head_size,
    block_size,
    q_token_stride,
    q_head_stride,
    q_elem_stride,
    k_token_stride,
    k_head_stride,
    k_elem_stride,
    v_token_stride,
    v_head_stride,
    v_elem_stride,
    kc_block_stride,
    kc_offset_stride,
    kc_head_stride,
    kc_elem_stride,
    vc_block_stride,
    vc_offset_stride,
    vc_head_stride,
    vc_elem_stride,
    pos_stride,
    cs_stride,
    cs_elem_stride,
    slot_stride,
    HALF: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotate heads ``[pid1 * HEAD_BLOCK, +HEAD_BLOCK)`` of token ``pid0``'s query and key; cache its key and value.

    Feature ``d < 2 * HALF`` of a head is rotated with its pair (NeoX: ``d +- HALF``; GPT-J:
    ``d ^ 1``) by the cosine and sine of frequency ``d mod HALF`` (``d // 2``); features past
    ``2 * HALF`` (partial rotary) are kept. Rotation in float32, rounded once on store, as the
    ``rotary_embedding`` reference does; values are copied bit for bit.
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    d = tl.arange(0, D_BLOCK)
    d_ok = d < head_size
    rot = d < 2 * HALF
    if IS_NEOX:
        first = d < HALF
        pair = tl.where(first, d + HALF, d - HALF)
        freq = tl.where(first, d, d - HALF)
        sign = tl.where(first, -1.0, 1.0)
    else:
        pair = d ^ 1
        freq = d // 2
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    pos = tl.load(pos_ptr + token * pos_stride).to(tl.int64)
    cs_row = cos_sin_ptr + pos * cs_stride
    cos = tl.load(cs_row + freq * cs_elem_stride, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + (HALF + freq) * cs_elem_stride, mask=rot, other=0.0).to(tl.float32)

    q_rows = q_ptr + token * q_token_stride
    q, q_mask = _rotate_rows(q_rows, heads, n_q_heads, q_head_stride, q_elem_stride, d, d_ok, pair, sign, cos, sin, rot)
    k_rows = k_ptr + token * k_token_stride
    k, k_mask = _rotate_rows(
        k_rows, heads, n_kv_heads, k_head_stride, k_elem_stride, d, d_ok, pair, sign, cos, sin, rot
    )
    v_ptrs = v_ptr + token * v_token_stride + heads[:, None] * v_head_stride + d[None, :] * v_elem_stride
    v = tl.load(v_ptrs, mask=k_mask, other=0.0)
    tl.debug_barrier()  # every partner feature is read before any feature of the row is overwritten
    q_out = q_rows + heads[:, None] * q_head_stride + d[None, :] * q_elem_stride
    tl.store(q_out, q.to(q_out.dtype.element_ty), mask=q_mask)
    k_out = k_rows + heads[:, None] * k_head_stride + d[None, :] * k_elem_stride
    k = k.to(k_out.dtype.element_ty)
    tl.store(k_out, k, mask=k_mask)

    slot = tl.load(slot_ptr + token * slot_stride).to(tl.int64)
    keep = slot >= 0
    block = tl.where(keep, slot, 0) // block_size
    offset = tl.where(keep, slot, 0) % block_size
    kc = kc_ptr + block * kc_block_stride + offset * kc_offset_stride
    tl.store(kc + heads[:, None] * kc_head_stride + d[None, :] * kc_elem_stride, k, mask=k_mask & keep)
    vc = vc_ptr + block * vc_block_stride + offset * vc_offset_stride
    tl.store(vc + heads[:, None] * vc_head_stride + d[None, :] * vc_elem_stride, v, mask=k_mask & keep)


def _strides(t: torch.Tensor, head_size: int) -> tuple[int, int, int, int]:
    """``(heads, token stride, head stride, feature stride)`` of ``[T, H * D]`` or ``[T, H, D]``."""
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1), t.stride(2)
    return t.shape[1] // head_size, t.stride(0), head_size * t.stride(1), t.stride(1)


@torch.library.custom_op(
    "vllm_port_cuda::rotary_embedding_and_cache", mutates_args=("query", "key", "key_cache", "value_cache")
)
def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """``rotary_embedding(positions, query, key, ...)`` then ``reshape_and_cache(key, value, ...)``, in one launch.

    ``key`` may be ``[T, kv_heads * head_size]`` or ``[T, kv_heads, head_size]``; ``value`` is
    ``[T, kv_heads, head_size]``; arguments are checked by the two ops' own checks.
    """
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    kv_heads, k_token, k_head, k_elem = _strides(key, head_size)
    check_reshape_and_cache(key.view(key.shape[0], kv_heads, head_size), value, key_cache, value_cache, slot_mapping)
    q_heads, q_token, q_head, q_elem = _strides(query, head_size)
    tokens = positions.shape[0]
    if tokens == 0:
        return
    d_block = next_power_of_2(head_size)
    most = max(q_heads, kv_heads)
    head_block = min(next_power_of_2(most), max(1, _MAX_PROGRAM_ELEMENTS // d_block))
    _rotary_cache_kernel[(tokens, cdiv(most, head_block))](
        query,
        key,
        value,
        positions,
        cos_sin_cache,
        key_cache,
        value_cache,
        slot_mapping,
        q_heads,
        kv_heads,
        head_size,
        key_cache.shape[1],
        q_token,
        q_head,
        q_elem,
        k_token,
        k_head,
        k_elem,
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        positions.stride(0),
        cos_sin_cache.stride(0),
        cos_sin_cache.stride(1),
        slot_mapping.stride(0),
        HALF=cos_sin_cache.shape[-1] // 2,
        HEAD_BLOCK=head_block,
        D_BLOCK=d_block,
        IS_NEOX=is_neox,
        num_warps=4,
    )


@rotary_embedding_and_cache.register_fake
def _(positions, query, key, value, key_cache, value_cache, slot_mapping, head_size, cos_sin_cache, is_neox):
    return None


# ------------------------------------------------------------------------------------------------
# The pass
# ------------------------------------------------------------------------------------------------

#: The providers whose pair the fused kernel replaces (this plugin's Triton ones).
_FUSABLE = {"rotary_embedding": "triton_rotary_embedding", "reshape_and_cache": "triton_reshape_and_cache"}


def _ours(node: fx.Node) -> bool:
    chosen = contract_provider(node)
    op = contract_op(node)
    return chosen is not None and chosen.plugin == "cuda" and _FUSABLE.get(op or "") == chosen.name


def _base(node: object) -> object:
    """The tensor ``node`` is a view of (through aliasing ops), or ``node`` itself."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.args:
        schema = getattr(node.target, "_schema", None)
        if schema is None or not any(r.alias_info is not None for r in schema.returns):
            break
        node = node.args[0]
    return node


def _only_views_between(start: fx.Node, end: fx.Node, watched: set[object]) -> bool:
    """Whether every node strictly between ``start`` and ``end`` that reads a watched tensor only makes a view."""
    node = start.next
    while node is not end:
        if any(_base(arg) in watched for arg in node.all_input_nodes):
            schema = getattr(node.target, "_schema", None)
            if schema is None or not any(r.alias_info is not None for r in schema.returns):
                return False
        node = node.next
    return True


def fuse_rotary_and_cache(module: fx.GraphModule, ctx: PassContext) -> int:
    """``rotary_embedding(pos, q, k)`` ... ``reshape_and_cache(view(k), v, ...)`` -> one ``rotary_embedding_and_cache``.

    Fires when the cache write's key is a view of the rotated key, only views of the query and
    key sit between the two ops, and both ops are bound to this plugin's Triton providers.
    """
    fired = 0
    for rotary in list(module.graph.nodes):
        if contract_op(rotary) != "rotary_embedding" or not _ours(rotary):
            continue
        positions, query, key, head_size, cos_sin, is_neox = rotary.args[:6]
        cache_write = next(
            (
                u
                for u in _all_views(key)
                if contract_op(u) == "reshape_and_cache" and _ours(u) and _base(u.args[0]) is key
            ),
            None,
        )
        if cache_write is None or not _only_views_between(rotary, cache_write, {query, key}):
            continue
        _, value, key_cache, value_cache, slots = cache_write.args[:5]
        with module.graph.inserting_before(cache_write):
            module.graph.call_function(
                torch.ops.vllm_port_cuda.rotary_embedding_and_cache.default,
                (positions, query, key, value, key_cache, value_cache, slots, head_size, cos_sin, is_neox),
            )
        module.graph.erase_node(cache_write)
        module.graph.erase_node(rotary)
        fired += 1
    if fired:
        module.graph.lint()
        module.recompile()
    return fired


def _all_views(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` and of its views."""
    found, todo = [], [node]
    while todo:
        for user in todo.pop().users:
            found.append(user)
            schema = getattr(user.target, "_schema", None)
            if schema is not None and any(r.alias_info is not None for r in schema.returns):
                todo.append(user)
    return found


def graph_passes() -> list[GraphPass]:
    """The passes the CUDA plugin contributes to flat graphs."""
    return [GraphPass("rotary_embedding_and_cache", fuse_rotary_and_cache)]
