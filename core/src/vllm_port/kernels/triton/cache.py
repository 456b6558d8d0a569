"""``reshape_and_cache``: copy each token's keys and values into its slot of the paged caches.

One program per (token, block of KV heads) copies ``HEAD_BLOCK x head_size`` keys and as many
values; a token whose slot is -1 (padding) writes nothing. Bytes per token:
``4 x kv_heads x head_size x itemsize`` (key and value read, then written). Values are copied
bit for bit: no conversion happens between the load and the store; for an FP8 cache
(``reshape_and_cache_fp8``, :mod:`.kv_fp8`) each is divided by its scale and rounded to e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.attention import check_reshape_and_cache
from ..triton_target import TritonTarget
from .fp8_linear import to_e4m3
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["CacheKernels"]

#: Elements (heads x head_size) of key, and as many of value, a program should cover at most.
_MAX_PROGRAM_ELEMENTS = 2048
#: Elements of each operand per thread (8 x 16-bit = one 16-byte vector).
_ELEMENTS_PER_THREAD = 8


@cached_launch
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_ptr,
    n_heads,
    head_size,
    block_size,
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
    slot_stride,
    k_scale,  # with QUANT: the cache holds e4m3(key / k_scale)
    v_scale,
    HEAD_BLOCK: tl.constexpr,
    D_BLOCK: tl.constexpr,
    QUANT: tl.constexpr,  # an FP8 cache (reshape_and_cache_fp8): divide by the scale, round to e4m3
    ROUND_FIRST: tl.constexpr,  # round on e4m3's grid in float32 first (see fp8_linear.to_e4m3)
):
    """Copy heads ``[pid1 * HEAD_BLOCK, pid1 * HEAD_BLOCK + HEAD_BLOCK)`` of token ``pid0`` into its slot.

    Args:
        key_ptr, value_ptr: ``[tokens, n_heads, head_size]`` with the given token, head and element
            (feature) strides.
        key_cache_ptr, value_cache_ptr: ``[num_blocks, block_size, n_heads, head_size]`` with the given
            block, offset-in-block, head and element strides.
        slot_ptr: int32/int64 ``slot_mapping``, ``slot_stride`` apart: slot ``s`` is offset
            ``s % block_size`` of block ``s // block_size``; -1 skips the token.
        n_heads, head_size, block_size: the cache's KV heads, head size and tokens per block.
        HEAD_BLOCK, D_BLOCK: heads per program and ``head_size`` padded to a power of two.

    Element strides are 1 in practice; Triton specialises a stride of 1 into a constant, so the
    feature axis compiles to contiguous vector accesses.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token * slot_stride).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    d = tl.arange(0, D_BLOCK)
    mask = (heads < n_heads)[:, None] & (d < head_size)[None, :]
    # The key and value loads do not wait for the slot: all three are in flight at once.
    k = tl.load(
        key_ptr + token * k_token_stride + heads[:, None] * k_head_stride + d[None, :] * k_elem_stride, mask=mask
    )
    v = tl.load(
        value_ptr + token * v_token_stride + heads[:, None] * v_head_stride + d[None, :] * v_elem_stride, mask=mask
    )
    mask = mask & (slot >= 0)
    if QUANT:  # the division in float32, as the op's reference
        k = to_e4m3(k.to(tl.float32) / k_scale, 448.0, ROUND_FIRST)
        v = to_e4m3(v.to(tl.float32) / v_scale, 448.0, ROUND_FIRST)
    kc = key_cache_ptr + block * kc_block_stride + offset * kc_offset_stride
    vc = value_cache_ptr + block * vc_block_stride + offset * vc_offset_stride
    tl.store(kc + heads[:, None] * kc_head_stride + d[None, :] * kc_elem_stride, k, mask=mask)
    tl.store(vc + heads[:, None] * vc_head_stride + d[None, :] * vc_elem_stride, v, mask=mask)


class CacheKernels:
    """Triton provider of ``reshape_and_cache``."""

    OPS = ("reshape_and_cache",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        self._write(key, value, key_cache, value_cache, slot_mapping)

    def _write(self, key, value, key_cache, value_cache, slot_mapping, scales=None, round_first=False) -> None:
        """Launch the copy on checked arguments; ``scales`` ``(k_scale, v_scale)`` quantise into an FP8 cache."""
        tokens, n_heads, head_size = key.shape
        if tokens == 0 or n_heads * head_size == 0:
            return
        d_block = next_power_of_2(head_size)
        head_block = min(next_power_of_2(n_heads), max(1, _MAX_PROGRAM_ELEMENTS // d_block))
        warps = (head_block * d_block) // (self.target.warp_size * _ELEMENTS_PER_THREAD)
        warps = max(1, min(self.target.max_warps, warps))
        _reshape_and_cache_kernel[(tokens, cdiv(n_heads, head_block))](
            key,
            value,
            key_cache,
            value_cache,
            slot_mapping,
            n_heads,
            head_size,
            key_cache.shape[1],
            *key.stride(),
            *value.stride(),
            *key_cache.stride(),
            *value_cache.stride(),
            slot_mapping.stride(0),
            *(scales or (1.0, 1.0)),
            HEAD_BLOCK=head_block,
            D_BLOCK=d_block,
            QUANT=scales is not None,
            ROUND_FIRST=round_first,
            num_warps=warps,
        )
