"""RMS norm and fused residual-add + RMS norm: one program normalises one row (or a few short rows).

A row of up to ``_MAX_RESIDENT`` features is loaded once and kept in registers between the sum of
squares and the scaling, so the kernel moves the minimum: ``rms_norm`` reads ``x`` and writes the
output (2 x hidden x itemsize per token); ``fused_add_rms_norm`` reads ``x`` and ``residual`` and
writes both the new residual and the output (4 x hidden x itemsize per token). ``weight`` is read
by every program but stays in L1/L2. Longer rows are walked in chunks twice (sum of squares, then
scaling), the second pass hitting L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.norm import check_fused_add_rms_norm, check_rms_norm
from ..triton_target import TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["NormKernels"]

#: Longest row (elements, padded to a power of two) held in registers; longer rows take two passes.
_MAX_RESIDENT = 16384
#: Chunk width of the two-pass path.
_CHUNK = 8192
#: Elements one program should cover at least: short rows are packed several to a program.
_MIN_PROGRAM_ELEMENTS = 2048
#: Elements each thread holds of a tile (16 bf16 = two 16-byte vectors).
_ELEMENTS_PER_THREAD = 16


@cached_launch
@triton.jit(do_not_specialize=["n_rows"])  # one compiled variant whatever the token count
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    n_rows,
    hidden,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    eps,
    FUSED_ADD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Normalise rows ``[pid * ROWS, pid * ROWS + ROWS)`` of ``x`` into ``out``.

    Args:
        out_ptr: output rows ``[n_rows, hidden]``, ``x``'s dtype, features contiguous.
        x_ptr: input rows, features contiguous, rows ``x_row_stride`` elements apart.
        res_ptr: with ``FUSED_ADD``, the residual rows, updated in place to ``residual + x`` (rounded to
            the dtype) and normalised instead of ``x``; otherwise unused.
        w_ptr: ``weight`` ``[hidden]``, contiguous, ``x``'s dtype.
        n_rows, hidden: rows and features.
        x_row_stride, res_row_stride, out_row_stride: elements between consecutive rows.
        eps: added to the mean of squares before the reciprocal square root.
        FUSED_ADD: add ``x`` into the residual first.
        ROWS: rows per program (several when rows are short).
        BLOCK: features per tile: ``>= hidden`` when ``CHUNKS`` is 1, else the chunk width.
        CHUNKS: tiles per row, ``cdiv(hidden, BLOCK)``. With one, the row is read once and kept in
            registers; with more, it is walked twice (a constant trip count, so the loops need no
            runtime bound).
    """
    dtype = x_ptr.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    cols = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    res_rows = res_ptr + rows[:, None] * res_row_stride
    out_rows = out_ptr + rows[:, None] * out_row_stride

    if CHUNKS == 1:
        mask = row_ok & (cols < hidden)[None, :]
        # Every load is issued before the first store (which the compiler cannot move them past). Evict-last on
        # the rows and the weight: 95% -> 98.5% of copy for fused_add_rms_norm at 4k-16k tokens and 4.6 -> 4.2 us
        # for rms_norm at 1k tokens on an H200 (dev/experiments/probe_rowwise.py, docs/results/ops-h200.md).
        w = tl.load(w_ptr + cols, mask=cols < hidden, other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if FUSED_ADD:
            r = tl.load(res_rows + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_last")
            r = r.to(tl.float32)
            x = (x + r).to(dtype)  # the residual stream keeps its dtype: round the sum once
            tl.store(res_rows + cols[None, :], x, mask=mask)
            x = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / hidden + eps)
        # Round the normalised value to the dtype, then scale (the rounding the reference does).
        y = (x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
        tl.store(out_rows + cols[None, :], y, mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for chunk in range(CHUNKS):
            c = chunk * BLOCK + cols
            mask = row_ok & (c < hidden)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if FUSED_ADD:
                r = tl.load(res_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(dtype)
                tl.store(res_rows + c[None, :], x, mask=mask)
                x = x.to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / hidden + eps)
        if FUSED_ADD:
            tl.debug_barrier()  # the second pass reads the residual this program just wrote
            x_rows = res_rows
        for chunk in range(CHUNKS):
            c = chunk * BLOCK + cols
            mask = row_ok & (c < hidden)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + c, mask=c < hidden, other=0.0).to(tl.float32)
            y = (x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
            tl.store(out_rows + c[None, :], y, mask=mask)


def _row_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as ``[rows, hidden]`` sharing its storage with features contiguous, or None if it cannot be."""
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    if t.dim() == 2:  # already rows (a view costs a microsecond of host time on every launch)
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


class NormKernels:
    """Triton providers of ``rms_norm`` and ``fused_add_rms_norm``."""

    OPS = ("rms_norm", "fused_add_rms_norm")

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        check_rms_norm(x, weight, epsilon)
        return self._launch(x, None, weight, epsilon)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
    ) -> torch.Tensor:
        check_fused_add_rms_norm(x, residual, weight, epsilon)
        return self._launch(x, residual, weight, epsilon)

    def _launch(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, epsilon: float
    ) -> torch.Tensor:
        hidden = x.shape[-1]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        x2 = _row_view(x)
        if x2 is None:
            x2 = x.contiguous().view(-1, hidden)
        res2, write_back = x2, False  # x2 stands in for the residual unless fused
        if residual is not None:
            res2 = _row_view(residual)
            write_back = res2 is None
            if write_back:  # update a packed copy, then copy it into the caller's tensor
                res2 = residual.contiguous().view(-1, hidden)
        out2 = out if out.dim() == 2 else out.view(-1, hidden)
        n_rows = x2.shape[0]

        block = next_power_of_2(hidden)
        resident = block <= _MAX_RESIDENT
        block = block if resident else _CHUNK
        rows = max(1, _MIN_PROGRAM_ELEMENTS // block) if resident else 1
        warps = (rows * block) // (self.target.warp_size * _ELEMENTS_PER_THREAD)
        warps = max(1, min(self.target.max_warps, warps))
        _rms_norm_kernel[(cdiv(n_rows, rows),)](
            out2,
            x2,
            res2,
            weight.contiguous(),
            n_rows,
            hidden,
            x2.stride(0),
            res2.stride(0),
            out2.stride(0),
            float(epsilon),
            FUSED_ADD=residual is not None,
            ROWS=rows,
            BLOCK=block,
            CHUNKS=cdiv(hidden, block),
            num_warps=warps,
        )
        if write_back:
            residual.copy_(res2.view(residual.shape))
        return out
