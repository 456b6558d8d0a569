"""Gated activations ``act(x[..., :d]) * x[..., d:]``: one program per (row, column block).

Each program reads ``BLOCK`` gate and ``BLOCK`` up values of one row and writes ``BLOCK`` outputs:
3 x d x itemsize bytes per token in all, the minimum. Splitting rows into column blocks gives even
a few tokens (decode) enough programs to reach every multiprocessor. Programs are numbered with the
column block varying fastest, so programs that run together stream neighbouring memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.activation import check_gated, check_gelu_and_mul
from ..triton_target import TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["ActivationKernels"]

#: Elements of each operand per thread: one 16-byte vector of 16-bit values for silu; two for gelu,
#: whose erf is costly enough that more independent work per thread pays (measured on an H200:
#: dev/tune_elementwise.py, docs/results/ops-h200.md).
_ELEMENTS_PER_THREAD = {"silu": 8, "gelu": 16, "gelu_tanh": 16}


@triton.jit
def _gelu_erf(g):
    """Exact (erf) GELU in float32, ``g (1 + erf(g / sqrt 2)) / 2``, with erfc by Abramowitz and Stegun 7.1.26.

    7.1.26 gives ``erfc(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2)``, ``t = 1 / (1 + p z)`` for
    ``z >= 0``, within 1.5e-7 absolute: one reciprocal, one exp2 and five multiply-adds, no branch, where libdevice's erf
    costs enough instructions to hold the kernel at 87% of the copy bandwidth on an H200 (this one: 103%,
    dev/experiments/probe_rowwise.py). With ``h = erfc(|g| / sqrt 2) / 2``, ``gelu(g) = g (1 - h)`` for ``g >= 0`` and ``g h``
    below (no cancellation for negative gates); ``p / sqrt 2``, the halved ``a_i`` and ``log2(e) / 2`` are folded in.
    """
    t = 1.0 / (1.0 + 0.2316418882663604 * tl.abs(g))
    h = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    h = h * tl.exp2(g * (g * -0.7213475204444817))
    return g * tl.where(g >= 0, 1.0 - h, h)


@cached_launch
@triton.jit
def _gated_kernel(
    out_ptr, x_ptr, d, blocks_per_row, x_row_stride, out_row_stride, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr
):
    """``out[row, cols] = act(x[row, cols]) * x[row, d + cols]`` for one row and one block of columns.

    Args:
        out_ptr: output ``[rows, d]``, ``x``'s dtype, columns contiguous, rows ``out_row_stride`` apart.
        x_ptr: input ``[rows, 2 * d]`` (gate half, then up half), columns contiguous, rows
            ``x_row_stride`` apart.
        d: output columns (half of ``x``'s).
        blocks_per_row: ``cdiv(d, BLOCK)``; program ``p`` serves row ``p // blocks_per_row``.
        ACTIVATION: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        BLOCK: columns per program.

    The activation is computed in float32 and rounded to the dtype before the product, which is
    rounded again on store: the two roundings of the reference's ``act(gate) * up`` in the dtype.
    """
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    elif ACTIVATION == "gelu":
        act = _gelu_erf(gate)
    else:  # gelu_tanh: 0.5 * (1 + tanh(z)) == sigmoid(2z), with z = sqrt(2 / pi) * (g + 0.044715 g^3)
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    y = act.to(dtype).to(tl.float32) * up
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=mask)


class ActivationKernels:
    """Triton providers of ``silu_and_mul`` and ``gelu_and_mul``."""

    OPS = ("silu_and_mul", "gelu_and_mul")

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        d = check_gated("silu_and_mul", x)
        return self._launch(x, d, "silu")

    def gelu_and_mul(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        d = check_gelu_and_mul(x, approximate)
        return self._launch(x, d, "gelu" if approximate == "none" else "gelu_tanh")

    def _launch(self, x: torch.Tensor, d: int, activation: str) -> torch.Tensor:
        out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        if x.stride(-1) != 1:
            x = x.contiguous()
        try:
            x2 = x.view(-1, 2 * d)
        except RuntimeError:  # leading dims that do not collapse into one row stride
            x2 = x.contiguous().view(-1, 2 * d)
        out2 = out.view(-1, d)
        block = min(self.target.elementwise_block, next_power_of_2(d))
        per_thread = _ELEMENTS_PER_THREAD[activation]
        warps = max(1, min(self.target.max_warps, block // (self.target.warp_size * per_thread)))
        blocks_per_row = cdiv(d, block)
        _gated_kernel[(x2.shape[0] * blocks_per_row,)](
            out2,
            x2,
            d,
            blocks_per_row,
            x2.stride(0),
            out2.stride(0),
            ACTIVATION=activation,
            BLOCK=block,
            num_warps=warps,
        )
        return out
