"""Rotary position embedding in place: one program per (token, block of heads), query and key alike.

A program loads its token's cosines and sines once and rotates the first ``rotary_dim`` features of
up to ``HEAD_BLOCK`` query heads and as many key heads; features past ``rotary_dim`` are not
touched. Bytes per token: ``2 x (heads + kv_heads) x rotary_dim x itemsize`` (read and write) plus
``rotary_dim x 4`` of table. NeoX pairs are two contiguous half-rows; GPT-J pairs are read as one
contiguous row and split in registers, so both styles use wide, coalesced accesses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.rotary import check_rotary_embedding
from ..triton_target import TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["RotaryKernels"]

#: Elements (heads x rotary features) of one tensor a program should cover at most.
_MAX_PROGRAM_ELEMENTS = 4096
#: Elements each thread holds of a tile.
_ELEMENTS_PER_THREAD = 16


@triton.jit
def _load_pairs(
    base_ptr,
    heads,
    n_heads,
    head_stride,
    elem_stride,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Load the rotary pairs of heads ``heads`` (those ``< n_heads``) of one token, as float32.

    Args:
        base_ptr: the token's first feature; head ``h``'s feature ``i`` is at
            ``base_ptr + h * head_stride + i * elem_stride``.
        heads: ``[HEAD_BLOCK]`` head indices.
        HALF: ``rotary_dim / 2``; ``HALF_BLOCK`` is it padded to a power of two.
        IS_NEOX: pair feature ``i`` with ``i + HALF`` (True) or ``2i`` with ``2i + 1`` (False).

    Returns ``(x1, x2, ptrs, mask)``: the pairs' two halves ``[HEAD_BLOCK, HALF_BLOCK]`` and where
    ``_store_pairs`` writes them back. NeoX halves are two contiguous loads; GPT-J pairs are one
    contiguous load split in registers.
    """
    head_ok = (heads < n_heads)[:, None]
    rows = base_ptr + heads[:, None] * head_stride
    if IS_NEOX:
        i = tl.arange(0, HALF_BLOCK)
        mask = head_ok & (i < HALF)[None, :]
        ptrs = rows + i[None, :] * elem_stride
        x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptrs + HALF * elem_stride, mask=mask, other=0.0).to(tl.float32)
    else:
        j = tl.arange(0, 2 * HALF_BLOCK)
        mask = head_ok & (j < 2 * HALF)[None, :]
        ptrs = rows + j[None, :] * elem_stride
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, [x.shape[0], HALF_BLOCK, 2]))  # even, odd features
    return x1, x2, ptrs, mask


@triton.jit
def _store_pairs(x1, x2, cos, sin, ptrs, mask, HALF: tl.constexpr, elem_stride, IS_NEOX: tl.constexpr):
    """Rotate the pairs loaded by ``_load_pairs`` by the token's ``cos``/``sin`` ``[HALF_BLOCK]`` and store them.

    The rotation is computed in float32 and rounded once, on store, to the tensor's dtype.
    """
    dtype = ptrs.dtype.element_ty
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    if IS_NEOX:
        tl.store(ptrs, o1.to(dtype), mask=mask)
        tl.store(ptrs + HALF * elem_stride, o2.to(dtype), mask=mask)
    else:
        tl.store(ptrs, tl.reshape(tl.join(o1, o2), [o1.shape[0], 2 * o1.shape[1]]).to(dtype), mask=mask)


@cached_launch
@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    n_q_heads,
    n_k_heads,
    q_token_stride,
    q_head_stride,
    q_elem_stride,
    k_token_stride,
    k_head_stride,
    k_elem_stride,
    pos_stride,
    cache_stride,
    cache_elem_stride,
    HALF: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotate heads ``[pid1 * HEAD_BLOCK, pid1 * HEAD_BLOCK + HEAD_BLOCK)`` of query and key for token ``pid0``.

    Args:
        q_ptr, k_ptr: query and key; head ``h`` of token ``t`` starts at ``t * *_token_stride +
            h * *_head_stride`` and its features are ``*_elem_stride`` apart (1 in practice).
        pos_ptr: int32/int64 token positions, ``pos_stride`` apart.
        cache_ptr: ``cos_sin_cache`` ``[max_position, 2 * HALF]``, rows ``cache_stride`` apart,
            features ``cache_elem_stride`` apart (1 in practice): ``HALF`` cosines then ``HALF`` sines.
        n_q_heads, n_k_heads: heads of query and key (heads past either are skipped).
        HALF, HALF_BLOCK, IS_NEOX: see ``_load_pairs``.
        HEAD_BLOCK: heads per program, of query and of key.

    Every load (query, key, and the table row once the position arrives) is issued before the
    first store, which the compiler could not move them past. Triton specialises a stride of 1
    into a constant, so feature axes compile to contiguous vector accesses.
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    pos = tl.load(pos_ptr + token * pos_stride).to(tl.int64)
    q_base = q_ptr + token * q_token_stride
    k_base = k_ptr + token * k_token_stride
    q1, q2, q_ptrs, q_mask = _load_pairs(
        q_base, heads, n_q_heads, q_head_stride, q_elem_stride, HALF, HALF_BLOCK, IS_NEOX
    )
    k1, k2, k_ptrs, k_mask = _load_pairs(
        k_base, heads, n_k_heads, k_head_stride, k_elem_stride, HALF, HALF_BLOCK, IS_NEOX
    )
    i = tl.arange(0, HALF_BLOCK)
    cs_row = cache_ptr + pos * cache_stride
    cos = tl.load(cs_row + i * cache_elem_stride, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_row + (HALF + i) * cache_elem_stride, mask=i < HALF, other=0.0).to(tl.float32)
    _store_pairs(q1, q2, cos, sin, q_ptrs, q_mask, HALF, q_elem_stride, IS_NEOX)
    _store_pairs(k1, k2, cos, sin, k_ptrs, k_mask, HALF, k_elem_stride, IS_NEOX)


def _head_strides(t: torch.Tensor, head_size: int) -> tuple[int, int, int, int]:
    """``(heads, token stride, head stride, feature stride)`` of ``[T, H * D]`` or ``[T, H, D]``."""
    if t.dim() == 3:
        return t.shape[1], t.stride(0), t.stride(1), t.stride(2)
    return t.shape[1] // head_size, t.stride(0), head_size * t.stride(1), t.stride(1)


class RotaryKernels:
    """Triton provider of ``rotary_embedding``."""

    OPS = ("rotary_embedding",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> None:
        check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
        tokens = positions.shape[0]
        q_heads, q_token, q_head, q_elem = _head_strides(query, head_size)
        k_heads, k_token, k_head, k_elem = _head_strides(key, head_size)
        most_heads = max(q_heads, k_heads)
        if tokens == 0 or most_heads == 0:
            return
        half = cos_sin_cache.shape[-1] // 2
        half_block = next_power_of_2(half)
        head_block = min(next_power_of_2(most_heads), max(1, _MAX_PROGRAM_ELEMENTS // (2 * half_block)))
        warps = (head_block * 2 * half_block) // (self.target.warp_size * _ELEMENTS_PER_THREAD)
        warps = max(1, min(self.target.max_warps, warps))
        _rotary_kernel[(tokens, cdiv(most_heads, head_block))](
            query,
            key,
            positions,
            cos_sin_cache,
            q_heads,
            k_heads,
            q_token,
            q_head,
            q_elem,
            k_token,
            k_head,
            k_elem,
            positions.stride(0),
            cos_sin_cache.stride(0),
            cos_sin_cache.stride(1),
            HALF=half,
            HALF_BLOCK=half_block,
            HEAD_BLOCK=head_block,
            IS_NEOX=is_neox,
            num_warps=warps,
        )
