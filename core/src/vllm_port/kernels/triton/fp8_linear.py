"""``fp8_linear``: activations quantised per token to e4m3, times an e4m3 weight, on FP8 tensor cores.

Two launches. :func:`_quantize_rows_kernel` gives each row (token) of ``x`` its scale
``max(amax(|row|), 1e-12) / 448`` and writes the row in e4m3 (one program a row: an amax pass, then a
quantising pass). :func:`_fp8_matmul_kernel` multiplies ``BLOCK_M x BLOCK_N`` output tiles over ``K`` in
``BLOCK_K`` steps with ``tl.dot`` on e4m3 operands and float32 accumulation (Hopper's and Ada's FP8 MMA),
applies the scales in the epilogue (per-group weight scales per ``K`` step, since a group's partial
product must be scaled before it joins the others), adds the bias and rounds once to ``x``'s dtype.

Decode (rows up to ``target.fp8_skinny_rows``) takes the target's skinny tiles, rows padded to 16 (the
dot's minimum), and splits ``K`` across programs until the device is full, like ``linear``'s split-K
kernel: float32 partials that ``linear``'s reduction kernel adds in a fixed order, with the bias, so
results are the same run to run. Prefill takes the wide tiles.

One row (batch-1 decode) with a per-tensor or per-channel scale takes ``linear``'s one-row kernel
instead, where the target gives it tiles (``fp8_one_row``): one launch, the e4m3 weight widened to
float32 in registers on the vector units, times ``x`` as it is, the scale applied to the sums. That is
the exact product the contract also allows, and at one row the weight's bytes are the whole cost.

Where a target has no FP8 dot (``fp8_dot=False``: Ampere, ROCm's MI300 whose FP8 is the fnuz variant,
XPU, Triton's CPU interpreter), the e4m3 operands are widened to bfloat16 before the dot (exact: every
e4m3 value is a bfloat16 value; float32 in the interpreter): the same quantisation, the weight still
read at one byte an element.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...device_properties import compute_units
from ...ops import BindContext
from ...ops.fp8 import FP8_GROUP, FP8_MAX, check_fp8_linear, fp8_linear_reference, scale_granularity
from ..triton_target import MatmulTiles, TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2
from .linear import LinearKernels

__all__ = ["Fp8LinearKernels", "to_e4m3"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_DOT_MIN = 16
_MAX_SPLITS = 16
_MIN_TILES_PER_SPLIT = 2
_INTERPRETER_SMS = 4
#: How the weight scale is laid out (constexpr of the matmul kernel).
_PER_TENSOR, _PER_CHANNEL, _PER_GROUP = 0, 1, 2


#: Outputs per program of the split reduction kernel.
_REDUCE_BLOCK = 1024


@cached_launch
@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [M, N], x's dtype, contiguous
    part_ptr,  # [SPLIT_K, M, N] float32
    b_ptr,
    total,  # M * N
    N,
    split_k,
    stride_b,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``out = sum(partials over splits, in split order) + bias``, rounded once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + (offs % N) * stride_b, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def to_e4m3(x, FP8_MAX: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """float32 ``x`` as e4m3, saturated at +-FP8_MAX, rounded to nearest even (see :func:`_quantize_rows_kernel`)."""
    q = tl.clamp(x, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(q), 2.0**-6))), -6.0)
        magic = tl.exp2(exponent - 3.0) * 12582912.0  # 1.5 x 2^23 steps of e4m3 at this magnitude
        q = (q + magic) - magic
    return q.to(tl.float8e4nv)


@cached_launch
@triton.jit
def _quantize_rows_kernel(
    q_ptr,  # [M, K] float8e4nv, contiguous
    s_ptr,  # [M] float32: each row's scale
    x_ptr,  # [M, K], any strides
    K,
    stride_xm,
    stride_xk,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_FIRST: tl.constexpr,  # round to the e4m3 grid in float32 before the (then exact) conversion
):
    """Row ``pid`` of ``x`` as e4m3 with the scale ``max(amax, 1e-12) / FP8_MAX`` (round to nearest even, saturated).

    ``ROUND_FIRST`` is for conversions that do not round to nearest even themselves (Triton's CPU interpreter
    rounds half away and drops the carry into the exponent: 127.6 becomes 64; GPUs without FP8 hardware
    convert in software): the value is rounded on e4m3's grid with float32's own round-to-nearest-even
    (adding and subtracting 1.5 x 2^23 steps), so the conversion only relabels it.
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + (k + offs) * stride_xk, mask=k + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / FP8_MAX
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + (k + offs) * stride_xk, mask=k + offs < K, other=0.0)
        q = to_e4m3(x.to(tl.float32) / scale, FP8_MAX, ROUND_FIRST)
        tl.store(q_ptr + row * K + k + offs, q, mask=k + offs < K)


@cached_launch
@triton.jit(do_not_specialize=["M"])
def _fp8_matmul_kernel(
    out_ptr,  # [M, N] x's dtype; with SPLIT float32 partials [SPLIT_K, M, N]
    q_ptr,  # [M, K] e4m3, contiguous (the quantised activations)
    xs_ptr,  # [M] float32 row scales
    w_ptr,  # [N, K] e4m3, any strides
    ws_ptr,  # weight scale: [1], [N] or [N, G] (contiguous)
    b_ptr,  # [N] bias (read without SPLIT)
    M,
    N,
    K,
    k_per_split,  # input features per split, a multiple of BLOCK_K
    groups,  # G, columns of a per-group scale
    stride_wn,
    stride_wk,
    stride_b,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides FP8_GROUP when SCALE is per group
    SCALE: tl.constexpr,  # 0 per tensor, 1 per channel, 2 per group of FP8_GROUP input features
    FP8_GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_DOT: tl.constexpr,  # e4m3 operands straight into tl.dot; else widened first
    WIDE_FP32: tl.constexpr,  # widen to float32 (the CPU interpreter) rather than bfloat16
):
    """One ``BLOCK_M x BLOCK_N`` tile of ``(q * xs) @ (w * ws).T`` over one split of ``K``."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    row_ok = rows < M
    col_ok = cols < N
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * K + (k_lo + ks)[None, :]
    w_ptrs = w_ptr + (k_lo + ks).to(tl.int64)[:, None] * stride_wk + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = k + ks < K
        a = tl.load(q_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if not FP8_DOT:
            wide = tl.float32 if WIDE_FP32 else tl.bfloat16
            a, b = a.to(wide), b.to(wide)
        if SCALE == 2:  # each group's partial product scaled before it joins the sum
            g = tl.load(ws_ptr + cols.to(tl.int64) * groups + k // FP8_GROUP, mask=col_ok, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * g[None, :]
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    acc *= tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if SCALE == 0:
        acc *= tl.load(ws_ptr)
    elif SCALE == 1:
        acc *= tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k.to(tl.int64) * M * N + offsets, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc, mask=mask)


def _splits(programs: int, k_tiles: int, num_sms: int, waves: int) -> int:
    """How many ways to split ``K``: until about ``waves`` programs a multiprocessor run, each split 2+ tiles."""
    wanted = waves * num_sms
    if waves == 0 or programs >= wanted or k_tiles < 2 * _MIN_TILES_PER_SPLIT:
        return 1
    split = min(cdiv(wanted, programs), k_tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS)
    return cdiv(k_tiles, cdiv(k_tiles, split))


class Fp8LinearKernels:
    """The Triton provider of ``fp8_linear``, launched with a target's tiles."""

    OPS = ("fp8_linear",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target
        self._one_row = LinearKernels(target)  # one token: linear's one-row kernel, the weight widened in registers

    def supports(self, ctx: BindContext) -> bool:
        """Bind-time predicate: the target enables the kernel (``fp8_skinny_rows`` > 0)."""
        return self.target.fp8_skinny_rows > 0

    def fp8_linear(
        self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ dequantize(weight, weight_scale).T + bias`` with ``x`` quantised per token (:mod:`vllm_port.ops.fp8`)."""
        check_fp8_linear(x, weight, weight_scale, bias)
        n, k = weight.shape
        rows = math.prod(x.shape[:-1])
        if x.dtype not in _DTYPES or rows == 0 or n == 0 or k == 0:
            return fp8_linear_reference(x, weight, weight_scale, bias)  # float64, or nothing to compute
        if rows == 1 and self.target.fp8_one_row is not None and scale_granularity(weight, weight_scale) != "group":
            # one token: the weight widened in registers on vector units, the exact product (no quantising launch)
            return self._one_row._launch(x, weight, bias, weight_scale=weight_scale, one_row=self.target.fp8_one_row)
        return self._launch(x, weight, weight_scale, bias)

    def _launch(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        split_k: int | None = None,
    ) -> torch.Tensor:
        """Quantise the rows, then multiply; ``split_k`` forces a split count (tests), else the device decides."""
        n, k = weight.shape
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
        xs = torch.empty((m,), dtype=torch.float32, device=x.device)
        block = min(next_power_of_2(k), 1024)
        interpreted = x.device.type == "cpu"
        _quantize_rows_kernel[(m,)](
            q, xs, x2, k, x2.stride(0), x2.stride(1),
            FP8_MAX=FP8_MAX, BLOCK=block, ROUND_FIRST=interpreted or not self.target.fp8_dot,
        )  # fmt: skip
        skinny = m <= self.target.fp8_skinny_rows
        tiles: MatmulTiles = self.target.fp8_skinny if skinny else self.target.fp8_wide
        block_m = max(_DOT_MIN, min(tiles.block_m, next_power_of_2(m))) if skinny else tiles.block_m
        granularity = scale_granularity(weight, weight_scale)
        scale_kind = {"tensor": _PER_TENSOR, "channel": _PER_CHANNEL, "group": _PER_GROUP}[granularity]
        block_k = min(tiles.block_k, FP8_GROUP) if scale_kind == _PER_GROUP else tiles.block_k
        grid_m, grid_n, k_tiles = cdiv(m, block_m), cdiv(n, tiles.block_n), cdiv(k, block_k)
        if split_k is None:
            waves = tiles.waves if skinny else 0
            split_k = _splits(grid_m * grid_n, k_tiles, compute_units(x.device, _INTERPRETER_SMS), waves)
        tiles_per_split = cdiv(k_tiles, split_k)
        split_k = cdiv(k_tiles, tiles_per_split)
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        dest = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
        scales = weight_scale.reshape(-1) if scale_kind != _PER_GROUP else weight_scale.contiguous()
        bias_arg = bias if bias is not None else xs
        _fp8_matmul_kernel[(grid_m, grid_n, split_k)](
            dest, q, xs, weight, scales, bias_arg,
            m, n, k, tiles_per_split * block_k, weight_scale.shape[-1] if scale_kind == _PER_GROUP else 1,
            weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
            BLOCK_M=block_m,
            BLOCK_N=tiles.block_n,
            BLOCK_K=block_k,
            SCALE=scale_kind,
            FP8_GROUP=FP8_GROUP,
            SPLIT=split_k > 1,
            HAS_BIAS=bias is not None,
            FP8_DOT=self.target.fp8_dot and not interpreted,
            WIDE_FP32=interpreted,
            num_warps=tiles.warps,
            num_stages=tiles.stages,
        )  # fmt: skip
        if split_k > 1:
            _reduce_splits_kernel[(cdiv(m * n, _REDUCE_BLOCK),)](
                out, dest, bias_arg, m * n, n, split_k,
                bias.stride(0) if bias is not None else 0,
                HAS_BIAS=bias is not None,
                BLOCK=_REDUCE_BLOCK,
                num_warps=4,
            )  # fmt: skip
        return out
