"""CPU providers of the contract ops, in torch: vectorised, no Python loop over tokens or sequences.

This module holds the element-wise, norm, linear and rotary providers and exports :data:`PROVIDERS`,
every provider of the plugin; the paged-cache ops live in :mod:`.attention`, sampling in
:mod:`.sampling`. Every provider first runs its op's argument check, so it refuses exactly what the
reference refuses, with the same message.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from vllm_port.ops import Provider, provider
from vllm_port.ops.activation import check_gated, check_gelu_and_mul
from vllm_port.ops.fp8 import check_fp8_linear, dequantize_fp8_weight
from vllm_port.ops.linear import check_embedding, check_linear, packed_rows
from vllm_port.ops.norm import check_fused_add_rms_norm, check_rms_norm
from vllm_port.ops.rotary import check_rotary_embedding

from . import attention, moe, native, native_elementwise, sampling

__all__ = ["PROVIDERS"]

#: oneDNN's linear ops are in this torch build (x86 and ARM builds have them)
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@provider("embedding", name="cpu_embedding", priority=10)
def embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_embedding(input_ids, weight)
    return F.embedding(input_ids, weight)  # takes int32 and int64 ids, any weight strides


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # torch's fused kernel, fed float32 (float64 stays): the mean of squares and the scaling happen
    # in the compute dtype, the result is rounded once to x's dtype and then scaled by the weight,
    # as the reference does. For float32 ``.to`` returns the kernel's fresh output, so ``mul_`` is safe.
    compute = torch.promote_types(x.dtype, torch.float32)
    return F.rms_norm(x.to(compute), (x.shape[-1],), eps=epsilon).to(x.dtype).mul_(weight)


@provider("rms_norm", name="cpu_rms_norm", priority=10)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_rms_norm(x, weight, epsilon)
    return _rms_norm(x, weight, epsilon)


@provider("fused_add_rms_norm", name="cpu_fused_add_rms_norm", priority=10)
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    residual.add_(x)  # rounded to residual's dtype, in place: the caller's residual stream
    return _rms_norm(residual, weight, epsilon)


#: Weights reordered into oneDNN's blocked layout, by ``id`` of the weight: ``(version, data_ptr, packed)``.
#: An entry leaves when its weight is freed (``weakref.finalize``), so an ``id`` is never reused stale;
#: the version and data pointer catch a weight changed in place.
_PACKED: dict[int, tuple[int, int, torch.Tensor]] = {}
#: oneDNN packs bfloat16 weights only where the CPU has the instructions for it (AVX-512 BW/VL/DQ or
#: AVX-NE-CONVERT; an AVX2-only EPYC has neither and refuses the reorder): elsewhere bfloat16 takes F.linear
_ONEDNN_DTYPES = (
    (torch.float32, torch.bfloat16) if _ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
)
#: bfloat16 products with more rows (prefill) run as fast through F.linear, which is oneDNN too
_ONEDNN_MAX_HALF_ROWS = 512


def _packed_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is not None and entry[0] == weight._version and entry[1] == weight.data_ptr():
        return entry[2]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    if entry is None:
        weakref.finalize(weight, _PACKED.pop, key, None)
    _PACKED[key] = (weight._version, weight.data_ptr(), packed)
    return packed


def _use_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        _ONEDNN
        and x.dtype in _ONEDNN_DTYPES
        and x.dim() == 2
        and 0 < x.shape[0] <= (_ONEDNN_MAX_HALF_ROWS if x.dtype != torch.float32 else x.shape[0])
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.numel() > 0
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))
        and not weight.is_inference()  # no version counter: an in-place change could not be seen
        and not (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))  # no autograd
    )


@provider("linear", name="cpu_linear", priority=10)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, bias)
    if _use_onednn(x, weight, bias):
        # oneDNN with the weight pre-packed once: F.linear's float32 GEMM goes through MKL, which runs
        # 2-3x slower than oneDNN on AMD CPUs, and even for bfloat16 (oneDNN either way) packing saves
        # the reorder every call does (20-35% of a decode step's GEMMs here)
        packed = _packed_weight(weight, x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(packed_rows(x), weight, bias)  # oneDNN / MKL GEMM with float32 accumulation for half types


@provider("fp8_linear", name="cpu_fp8_linear", priority=10)
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    # No FP8 arithmetic on the host: the weight is dequantised into x's dtype for each call (the model keeps
    # its FP8 bytes, half of bfloat16's) and multiplied exactly, as the reference does, with no activation
    # quantisation: more accurate than the contract requires.
    check_fp8_linear(x, weight, weight_scale, bias)
    return F.linear(packed_rows(x), dequantize_fp8_weight(weight, weight_scale, x.dtype), bias).contiguous()


@provider("rotary_embedding", name="cpu_rotary_embedding", priority=10)
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    compute = torch.promote_types(query.dtype, torch.float32)
    cos_sin = cos_sin_cache.index_select(0, positions).to(compute)  # [tokens, rot]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for t in (query, key):  # two tensors, not a loop over tokens
        # splits the last dimension: a view for any row stride (heads named, not -1: a batch may have 0 tokens)
        heads = t.view(t.shape[0], t.shape[-1] // head_size if t.dim() == 2 else t.shape[1], head_size)
        # the two members of every rotated pair, as views into t: NeoX halves or GPT-J even/odd features
        x1, x2 = (heads[..., :half], heads[..., half:rot]) if is_neox else (heads[..., 0:rot:2], heads[..., 1:rot:2])
        a, b = x1.to(compute), x2.to(compute)  # for float32 these alias t: compute both outputs first
        o1 = a * cos - b * sin
        o2 = b * cos + a * sin
        x1.copy_(o1)  # rounds once to t's dtype, in place
        x2.copy_(o2)


@provider("silu_and_mul", name="cpu_silu_and_mul", priority=10)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = check_gated("silu_and_mul", x)
    # torch keeps a dense input's memory order: contiguous (a no-op but for such an input), as the contract returns
    return F.silu(x[..., :d]).mul_(x[..., d:]).contiguous()


@provider("gelu_and_mul", name="cpu_gelu_and_mul", priority=10)
def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    d = check_gelu_and_mul(x, approximate)
    return F.gelu(x[..., :d], approximate=approximate).mul_(x[..., d:]).contiguous()  # as silu_and_mul


#: Every provider of the CPU plugin, in the order of ``vllm_port.ops.ALL_OPS``: one per contract op, and
#: for the attention, cache write, norm, rotary and silu_and_mul ops the native kernels (:mod:`.native`,
#: :mod:`.native_elementwise`) above the torch ones, which serve when the native kernels cannot be
#: built (docs/results/cpu-elementwise.md has the element-wise kernels' measurements).
PROVIDERS: list[Provider] = [
    embedding,
    native_elementwise.rms_norm,
    rms_norm,
    native_elementwise.fused_add_rms_norm,
    fused_add_rms_norm,
    linear,
    fp8_linear,
    native_elementwise.rotary_embedding,
    rotary_embedding,
    native.reshape_and_cache,
    attention.reshape_and_cache,
    native.prefill_attention,
    attention.prefill_attention,
    native.paged_attention,
    attention.paged_attention,
    attention.reshape_and_cache_fp8,
    attention.prefill_attention_fp8,
    attention.paged_attention_fp8,
    native_elementwise.silu_and_mul,
    silu_and_mul,
    gelu_and_mul,
    moe.fused_moe,
    sampling.process_logits,
    sampling.sample,
    sampling.top_logprobs,
]
