# ruff: noqa: N803  (Triton's constexpr parameters are upper case)
"""Probe the element-wise and row-wise misses of issue 17 on one GPU, in one run of about 3 minutes on an H200.

    python3 dev/experiments/probe_rowwise.py [--out DIR] [--json FILE] [--sections erf,gelu,norm,small] [--budget-s 150]
    TRITON_INTERPRET=1 python3 dev/experiments/probe_rowwise.py --tiny      # CPU: every variant against float64, no timing

The misses (docs/results/ops-h200.md, "Against the goals"): ``gelu_and_mul`` at 16k/32k tokens x 14336
below 90% of the copy bandwidth, Inductor plateauing at the same place (the exact erf's float32 cost
suspected); ``fused_add_rms_norm`` at >= 4096 tokens x 4096 at 0.95-0.97x Inductor and ``rms_norm``
at 1024 tokens at 0.94x; element-wise ops at 1-16 tokens slower than Inductor (1.4 vs 1.2 us).

Sections, each a few cases (op x tokens, bf16, the inputs of ``vllm-port bench ops``):

- ``erf``: the largest error of each erf formulation (libdevice; Abramowitz-Stegun 7.1.26, |error| <= 1.5e-7
  in exact arithmetic; the same through PTX's flush-to-zero ex2/rcp; the tanh GELU for scale) against float64
  torch over a dense grid, computed by a Triton kernel in float32 as the variants compute it.
- ``gelu``: gelu_and_mul at 16k and 32k tokens: the shipped kernel, Inductor, two floors that move the
  same bytes with a cheaper activation (shipped silu_and_mul, shipped tanh GELU), and variants: erf by
  libdevice or A-S 7.1.26 (one reciprocal, one exp2, no branch), elements per thread and warps, eviction
  hints and streaming stores, and Inductor's flat 1-D indexing. Static SASS counts for sm_90 (offline
  compile, 16 elements per thread): silu 38.5 instructions per element, libdevice GELU 57, A-S 47,
  A-S with ftz ex2/rcp 42, tanh GELU 42.5.
- ``norm``: fused_add_rms_norm at 4096 and 16384 tokens, rms_norm at 1024: one-pass variants (rows per
  program, warps 4/8/16, evict-first/evict-last, residual stored before or after the reduction) and
  two-pass variants shaped like Inductor's looped reduction (chunk = hidden or hidden / 2, 16 warps,
  evict-last in the first loop, evict-first in the second).
- ``small``: silu_and_mul at 1 and 16 tokens: block and warps variants, Inductor's flat launch shape,
  and the shipped kernel through its wrapper, as a bare JIT launch and as a compiled-kernel launch
  (device time under graph replay, and host time per call).

Every implementation is first checked against float64 torch at the timed shape (the op's tolerance
and the contract's precision statistics: mean error <= 1.5x, max error <= 2x the reference run in
bf16); one that fails is reported and not timed. Times: ``graph`` is the median device time of
calls captured in one CUDA graph and replayed (``vllm-port bench ops``'s method, warm L2),
``cold`` is triton's ``do_bench`` median with the L2 flushed before each call (it includes the host's
launch where that outlasts the flush, so read ``graph`` at 1-16 tokens). ``copy`` is a device copy of
the same bytes timed the same way; ``xInd`` is Inductor's time over this one (> 1: faster).

Inductor's generated code for each case goes to ``OUT/inductor-<op>-<tokens>.py``, headed by the launch
configurations its autotuner kept (block sizes, warps, registers); PTX and SASS of Inductor's kernel,
the shipped kernel and the fastest variant of each case go to ``OUT/asm/``. The JSON (``OUT/probe-rowwise.json``
unless ``--json``) is rewritten after each section. Cases and variants past ``--budget-s`` are listed as
skipped, so a run stays inside one device call.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if "--tiny" in sys.argv:  # before any kernel is defined: Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import vllm_port.ops as ops
from vllm_port.bench._timing import graph_median_ms
from vllm_port.bench.ops import workload
from vllm_port.kernels.triton import activation as shipped_activation
from vllm_port.kernels.triton import norm as shipped_norm
from vllm_port.ops._op import MAX_ERROR_FACTOR, MEAN_ERROR_FACTOR, Tolerance
from vllm_port_cuda.triton_targets import CUDA

DTYPE = torch.bfloat16
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# ---------------------------------------------------------------------------------------------------------------------
# Kernels: the candidate variants (the shipped kernels are imported, never edited)
# ---------------------------------------------------------------------------------------------------------------------


# Abramowitz & Stegun 7.1.26: erf(z) = 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2), t = 1 / (1 + p z),
# for z >= 0, |error| <= 1.5e-7: one reciprocal, one exp2, five multiply-adds, no branch.
@triton.jit
def _erfc_abs_as(z):
    """``erfc(|z|)`` by A-S 7.1.26 in float32 (``erf(z) = 1 - erfc(|z|)`` for z >= 0, ``erfc(|z|) - 1`` below)."""
    a = tl.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return poly * tl.exp2(-1.4426950408889634 * a * a)


@triton.jit
def _ex2_ftz(x):
    """``2^x`` by the special-function unit, denormals flushed (``tl.exp2`` adds a range fix-up around it). CUDA only."""
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rcp_ftz(x):
    """``1 / x`` by the special-function unit alone (``/`` is div.full: a reciprocal plus range handling). CUDA only."""
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gelu_as(g, FTZ: tl.constexpr):
    """``gelu(g) = g (1 + erf(g / sqrt 2)) / 2`` with A-S 7.1.26's erfc, the constants folded for fewest operations.

    With ``q = erfc(|g| / sqrt 2)``: ``gelu(g) = g (1 - q / 2)`` for g >= 0 and ``g q / 2`` below (no cancellation for
    negative gates). ``q / 2 = t (a1 + ... + a5 t^4) / 2 * 2^(-g^2 log2(e) / 2)`` with ``t = 1 / (1 + p |g| / sqrt 2)``:
    the halved coefficients, p / sqrt 2 = 0.2316418882663604 and log2(e) / 2 = 0.7213475204444817 are folded in.
    """
    den = 1.0 + 0.2316418882663604 * tl.abs(g)
    if FTZ:
        t = _rcp_ftz(den)
    else:
        t = 1.0 / den
    half_q = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    power = g * (g * -0.7213475204444817)
    if FTZ:
        half_q = half_q * _ex2_ftz(power)
    else:
        half_q = half_q * tl.exp2(power)
    return g * tl.where(g >= 0, 1.0 - half_q, half_q)


@triton.jit
def _activation(gate, ACT: tl.constexpr):
    """``act(gate)`` in float32: ``silu``; ``gelu_libdevice`` (the shipped erf); ``gelu_as`` (A-S 7.1.26, see
    :func:`_gelu_as`); ``gelu_as_ftz`` (the same through PTX's flush-to-zero ex2/rcp, CUDA only); ``gelu_tanh``."""
    if ACT == "silu":
        act = gate / (1.0 + tl.exp(-gate))
    elif ACT == "gelu_libdevice":
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    elif ACT == "gelu_as":
        act = _gelu_as(gate, False)
    elif ACT == "gelu_as_ftz":
        act = _gelu_as(gate, True)
    else:  # gelu_tanh, as the shipped kernel computes it
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    return act


@triton.jit
def _erf_grid_kernel(out_ptr, in_ptr, n, WHAT: tl.constexpr, METHOD: tl.constexpr, BLOCK: tl.constexpr):
    """``out = erf(in)`` (WHAT ``"erf"``) or ``gelu(in)`` (``"gelu"``), float32 in and out, by METHOD."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(in_ptr + offs, mask=mask, other=0.0)
    if WHAT == "erf":
        if METHOD == "libdevice":
            y = tl.erf(v)
        else:
            q = _erfc_abs_as(v)
            y = tl.where(v >= 0, 1.0 - q, q - 1.0)
    else:
        y = _activation(v, "gelu_" + METHOD)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _gated_2d_kernel(
    out_ptr,
    x_ptr,
    d,
    blocks_per_row,
    x_row_stride,
    out_row_stride,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    EVICT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    """The shipped gated kernel's grid (column block fastest), with the activation, load hints and store modifier open."""
    dtype = x_ptr.dtype.element_ty
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    y = _activation(gate, ACT).to(dtype).to(tl.float32) * up
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=mask, cache_modifier=STORE_CACHE)


@triton.jit
def _gated_flat_kernel(out_ptr, x_ptr, n, D: tl.constexpr, ACT: tl.constexpr, XBLOCK: tl.constexpr):
    """Inductor's pointwise shape: one flat index over the ``n = rows * D`` outputs, int32, D a constant (x contiguous)."""
    dtype = x_ptr.dtype.element_ty
    idx = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = idx < n
    col = idx % D
    row = idx // D
    gate = tl.load(x_ptr + (col + 2 * D * row), mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + (D + col + 2 * D * row), mask=mask, other=0.0).to(tl.float32)
    y = _activation(gate, ACT).to(dtype).to(tl.float32) * up
    tl.store(out_ptr + idx, y, mask=mask)


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """A float32 load, predicated only when the tile can overhang (Triton refuses ``other`` without a mask)."""
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=EVICT)
    else:
        v = tl.load(ptrs, eviction_policy=EVICT)
    return v.to(tl.float32)


@triton.jit
def _store(ptrs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _norm_one_pass_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    n_rows,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    FUSED: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_X: tl.constexpr,
    EVICT_W: tl.constexpr,
    LATE_STORE: tl.constexpr,
):
    """Rows held in registers (as shipped), with int32 indexing, a constant width (no column mask when BLOCK == HIDDEN),
    eviction hints on the streamed rows (EVICT_X) and the weight (EVICT_W), and the residual stored before the
    reduction (as shipped) or after it, next to the output (LATE_STORE)."""
    dtype = x_ptr.dtype.element_ty
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < HIDDEN)[None, :]
    w = _load(w_ptr + cols, cols < HIDDEN, MASKED, EVICT_W)
    x = _load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask, MASKED, EVICT_X)
    if FUSED:
        r = _load(res_ptr + rows[:, None] * res_row_stride + cols[None, :], mask, MASKED, EVICT_X)
        s = (x + r).to(dtype)
        if not LATE_STORE:
            _store(res_ptr + rows[:, None] * res_row_stride + cols[None, :], s, mask, MASKED)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / HIDDEN + eps)
    y = (x * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
    if FUSED:
        if LATE_STORE:
            _store(res_ptr + rows[:, None] * res_row_stride + cols[None, :], s, mask, MASKED)
    _store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], y, mask, MASKED)


@triton.jit
def _norm_two_pass_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    eps,
    HIDDEN: tl.constexpr,
    CHUNK: tl.constexpr,
    FUSED: tl.constexpr,
    RELOAD: tl.constexpr,
):
    """One row per program in two loops over CHUNK-wide tiles, as Inductor's looped reduction: the first loop reads
    (evict-last) and sums the squares, the second re-reads (evict-first, from L2) and scales. With FUSED, RELOAD
    ``"res"`` stores the new residual in the first loop and re-reads it; ``"xr"`` re-reads x and the old residual,
    adds again and stores the residual in the second loop. HIDDEN must be a multiple of CHUNK."""
    dtype = x_ptr.dtype.element_ty
    row = tl.program_id(0)
    x_row = x_ptr + row * x_row_stride
    res_row = res_ptr + row * res_row_stride
    out_row = out_ptr + row * out_row_stride
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, HIDDEN, CHUNK):
        c = start + tl.arange(0, CHUNK)
        x = tl.load(x_row + c, eviction_policy="evict_last").to(tl.float32)
        if FUSED:
            r = tl.load(res_row + c, eviction_policy="evict_last").to(tl.float32)
            s = (x + r).to(dtype)
            if RELOAD == "res":
                tl.store(res_row + c, s)
            x = s.to(tl.float32)
        acc += x * x
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / HIDDEN + eps)
    if FUSED:
        if RELOAD == "res":
            tl.debug_barrier()  # the second loop reads what this program's threads wrote (the shipped kernel does too)
    for start in range(0, HIDDEN, CHUNK):
        c = start + tl.arange(0, CHUNK)
        if FUSED:
            if RELOAD == "res":
                v = tl.load(res_row + c, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_row + c, eviction_policy="evict_first").to(tl.float32)
                r = tl.load(res_row + c, eviction_policy="evict_first").to(tl.float32)
                s = (x + r).to(dtype)
                tl.store(res_row + c, s)
                v = s.to(tl.float32)
        else:
            v = tl.load(x_row + c, eviction_policy="evict_first").to(tl.float32)
        w = tl.load(w_ptr + c, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_row + c, (v * rstd).to(dtype).to(tl.float32) * w)


# ---------------------------------------------------------------------------------------------------------------------
# Cases, checks and timing
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One op at one token count: its arguments, the bytes it must move, and its float64 answers (computed lazily)."""

    section: str
    op: str
    tokens: int
    args: tuple[Any, ...]
    nbytes: int
    residual0: torch.Tensor | None = None  # fused_add_rms_norm: the residual before any call, to restore
    _wanted: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.op} {self.tokens}"

    def restore(self) -> None:
        if self.residual0 is not None:
            self.args[1].copy_(self.residual0)


@dataclass
class Impl:
    """One implementation to check and time: ``make(case)`` builds (and may compile) a call returning its output.

    ``reference``: the op whose float64 reference judges it (another op for the floors, which compute something
    else on the same bytes); ``extra``: arguments appended for that reference (``"tanh"``); ``jit``: the Triton
    kernel it launches, for its registers and assembly.
    """

    name: str
    kind: str  # "shipped", "inductor", "floor", "variant", "launch"
    make: Callable[[Case], Callable[[], Any]]
    reference: str | None = None
    extra: tuple[Any, ...] = ()
    jit: Any = None
    applies: Callable[[Case], bool] = lambda case: True


class Budget:
    """Wall-clock budget of the run: what would start after it is recorded as skipped."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.seconds


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _chunk_rows(width: int) -> int:
    return max(1, (1 << 25) // max(1, width))  # 32M elements per float64 step: 256 MiB


def _slice_args(args: tuple[Any, ...], lo: int, hi: int, upcast: bool) -> tuple[Any, ...]:
    """Rows ``lo:hi`` of every 2-D argument (the weight and scalars whole), float64 copies when ``upcast``."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            a = a[lo:hi]
            a = a.to(torch.float64) if upcast else a.clone()
        elif isinstance(a, torch.Tensor) and upcast:
            a = a.to(torch.float64)
        out.append(a)
    return tuple(out)


def _error_stats(got: torch.Tensor, want: torch.Tensor, tol: Tolerance) -> dict[str, float]:
    """Largest and mean absolute error of ``got`` against float64 ``want``, and how many elements are outside ``tol``."""
    got, want = _rows_of(got), _rows_of(want)
    step = _chunk_rows(want.shape[-1])
    worst, total, bad = 0.0, 0.0, 0
    for lo in range(0, want.shape[0], step):
        w = want[lo : lo + step]
        err = (got[lo : lo + step].to(torch.float64) - w).abs()
        bad += int((~(err <= tol.atol + tol.rtol * w.abs())).sum())  # NaN counts as bad
        err = torch.nan_to_num(err, nan=math.inf)
        worst, total = max(worst, float(err.max())), total + float(err.sum())
    return {"max": worst, "mean": total / max(1, want.numel()), "bad": bad}


def _wanted(case: Case, op_name: str, extra: tuple[Any, ...]) -> dict[str, Any]:
    """Float64 answers of ``op_name`` on the case's inputs, with the error statistics a correct bf16 kernel reaches."""
    key = f"{op_name}{extra}"
    if key in case._wanted:
        return case._wanted[key]
    op = getattr(ops, op_name)
    tol = op.tolerances[DTYPE]
    case.restore()
    args = (*case.args, *extra)
    rows = case.args[0].shape[0]
    step = _chunk_rows(case.args[0].shape[-1])
    outs, residuals, base_outs, base_res = [], [], [], []
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        wide = _slice_args(args, lo, hi, upcast=True)
        outs.append(op.reference(*wide))
        narrow = _slice_args(args, lo, hi, upcast=False)  # the reference in bf16 (float32 inside): the precision bar
        base_outs.append(op.reference(*narrow))
        if case.residual0 is not None:
            residuals.append(wide[1])
            base_res.append(narrow[1])
    want = {"out": torch.cat(outs)}
    baseline = {"out": torch.cat(base_outs)}
    if residuals:
        want["residual"], baseline["residual"] = torch.cat(residuals), torch.cat(base_res)
    bars = {}
    for name, w in want.items():
        ref = _error_stats(baseline[name], w, tol)
        best = _error_stats(w.to(DTYPE), w, tol)  # one rounding of the exact answer: the best any kernel returns
        bars[name] = {"mean": max(ref["mean"], best["mean"]), "max": max(ref["max"], best["max"])}
    del baseline
    case._wanted[key] = {"want": want, "bars": bars, "tol": tol}
    return case._wanted[key]


def check(case: Case, impl: Impl, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` once on fresh inputs and judge each output against float64 (tolerance and precision statistics)."""
    wanted = _wanted(case, impl.reference or case.op, impl.extra)
    case.restore()
    out = fn()
    got = {"out": out}
    if case.residual0 is not None:
        got["residual"] = case.args[1]
    verdict: dict[str, Any] = {"ok": True, "why": []}
    for name, want in wanted["want"].items():
        stats = _error_stats(got[name], want, wanted["tol"])
        bar = wanted["bars"][name]
        verdict[name] = stats
        if stats["bad"]:
            verdict["why"].append(f"{name}: {stats['bad']} elements outside the tolerance")
        if stats["mean"] > MEAN_ERROR_FACTOR * bar["mean"] or stats["max"] > MAX_ERROR_FACTOR * bar["max"]:
            verdict["why"].append(
                f"{name}: precision lost (mean {stats['mean']:.3g} vs {bar['mean']:.3g}, max {stats['max']:.3g} "
                f"vs {bar['max']:.3g})"
            )
    verdict["ok"] = not verdict["why"]
    case.restore()
    return verdict


class Timer:
    """Graph replay (bench ops' method) and do_bench with the L2 flushed; nothing on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture = None
        if device.type == "cuda":
            from vllm_port.plugin_kit import StreamGraphCapture

            self.capture = StreamGraphCapture("cuda graphs")  # what the CUDA plugin's graph_capture() returns

    def graph_us(self, fn: Callable[[], Any], nbytes: int) -> float:
        calls = 20 if nbytes < (256 << 20) else 5  # every captured call keeps its output alive in the graph's pool
        return graph_median_ms(fn, self.capture, self.device, calls=calls) * 1e3

    def cold_us(self, fn: Callable[[], Any]) -> float:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3

    def host_us(self, fn: Callable[[], Any], calls: int = 200) -> float:
        """Host time per call of back-to-back launches (the device finishes 1-2 us kernels faster than they are queued)."""
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / calls * 1e6


def _kernel_cache(jit: Any) -> dict[int, Any]:
    """Every compiled variant of a Triton kernel, by id (empty under the interpreter)."""
    found: dict[int, Any] = {}
    for cache in getattr(jit, "device_caches", {}).values():
        for kernel in cache[0].values():
            found[id(kernel)] = kernel
    return found


_COMPILED: dict[str, Any] = {}  # impl name -> its compiled kernel (registers, assembly)
_INDUCTOR_KEPT: dict[str, str] = {}  # case label -> the launch configurations Inductor kept, in one line


def _compiled_info(kernel: Any) -> dict[str, Any]:
    info: dict[str, Any] = {}
    for attr in ("n_regs", "n_spills"):
        value = getattr(kernel, attr, None)
        if isinstance(value, int):
            info[attr] = value
    metadata = getattr(kernel, "metadata", None)
    for attr in ("num_warps", "num_stages", "shared"):
        value = getattr(metadata, attr, None)
        if isinstance(value, int):
            info[attr] = value
    return info


def _dump_asm(asm: Any, stem: Path) -> list[str]:
    """PTX and SASS (``asm``: a compiled kernel's ``asm`` mapping) as ``stem.ptx`` and ``stem.sass``."""
    written = []
    for kind in ("ptx", "sass"):
        try:
            text = asm[kind]  # SASS is disassembled on demand by Triton's bundled cuobjdump
        except Exception as exc:  # a missing tool costs the file, not the run
            text = f"// {kind} unavailable: {type(exc).__name__}: {exc}"
        path = stem.with_suffix(f".{kind}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
        written.append(str(path))
    return written


def _cached_asm(cache_hash: str) -> dict[str, Any] | None:
    """PTX and SASS of a kernel in Triton's cache by its key (Inductor's static launcher keeps no compiled object)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from triton.tools.disasm import get_sass

    roots = [os.environ.get("TRITON_CACHE_DIR"), os.path.join(cache_dir(), "triton"), Path.home() / ".triton" / "cache"]
    for root in (Path(r) for r in roots if r):
        for folder in root.rglob(cache_hash) if root.is_dir() else ():
            ptx, cubin = next(folder.glob("*.ptx"), None), next(folder.glob("*.cubin"), None)
            if ptx is not None and cubin is not None:
                return {"ptx": ptx.read_text(), "sass": get_sass(cubin.read_bytes())}
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Inductor
# ---------------------------------------------------------------------------------------------------------------------


def _inductor_kernels(modules_before: int) -> list[dict[str, Any]]:
    """Launch configurations Inductor's autotuners kept, from the modules its last compile loaded."""
    from torch._inductor.codecache import PyCodeCache

    modules = list(getattr(PyCodeCache, "modules", []))[modules_before:]
    seen: dict[int, tuple[str, Any]] = {}
    for module in modules:
        for name, obj in vars(module).items():
            try:  # a module global's __getattr__ may raise anything (torch's op namespaces do)
                tuner = hasattr(obj, "launchers") and hasattr(obj, "configs")
            except Exception:
                tuner = False
            if tuner:
                seen.setdefault(id(obj), (name, obj))
    kernels = []
    for name, tuner in seen.values():
        for launcher in tuner.launchers:
            config = launcher.config
            entry = {
                "kernel": name,
                "kept": {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages},
                "candidates": [{**c.kwargs, "num_warps": c.num_warps} for c in tuner.configs],
                "n_regs": getattr(launcher, "n_regs", None),
                "n_spills": getattr(launcher, "n_spills", None),
                "_bin": getattr(launcher, "bin", None),  # set only with store_cubin; else found by cache_hash
                "_hash": getattr(launcher, "cache_hash", None),
            }
            kernels.append(entry)
    return kernels


def inductor_impl(out_dir: Path | None, record: dict[str, Any]) -> Impl:
    """The op's reference compiled by Inductor with static shapes (as bench ops does), its code dumped on first call."""

    def make(case: Case) -> Callable[[], Any]:
        from torch._inductor.codecache import PyCodeCache
        from torch._inductor.utils import run_and_get_code

        compiled = torch.compile(getattr(ops, case.op).reference, dynamic=False)
        before = len(getattr(PyCodeCache, "modules", []))
        case.restore()
        _, sources = run_and_get_code(compiled, *case.args)  # resets dynamo: time each compiled peer right away
        kernels = []
        try:
            kernels = _inductor_kernels(before)
        except Exception as exc:  # introspection of Inductor's internals is best effort
            kernels = [{"error": f"{type(exc).__name__}: {exc}"}]
        record[case.label] = [{k: v for k, v in kern.items() if not k.startswith("_")} for kern in kernels]
        _COMPILED["inductor " + case.label] = [(k.get("_bin"), k.get("_hash")) for k in kernels]
        _INDUCTOR_KEPT[case.label] = "; ".join(
            f"{k['kernel']} {' '.join(f'{n}={v}' for n, v in k['kept'].items())} regs {k['n_regs']}"
            for k in kernels
            if "kept" in k
        )
        if out_dir is not None:
            header = "\n".join(f"# kept: {json.dumps(record[case.label][i], default=str)}" for i in range(len(kernels)))
            path = out_dir / f"inductor-{case.op}-{case.tokens}.py"
            path.write_text(f"# Inductor's code for {case.label} ({DTYPE}), torch {torch.__version__}\n{header}\n\n")
            with path.open("a") as f:
                f.write("\n\n# ----- next module -----\n\n".join(sources))
        return lambda: compiled(*case.args)

    return Impl("inductor (torch.compile of the reference)", "inductor", make)


# ---------------------------------------------------------------------------------------------------------------------
# Implementations per section
# ---------------------------------------------------------------------------------------------------------------------


def _shipped_activation(method: str, extra: tuple[Any, ...] = ()) -> Callable[[Case], Callable[[], Any]]:
    def make(case: Case) -> Callable[[], Any]:
        fn = getattr(shipped_activation.ActivationKernels(CUDA), method)
        x = case.args[0]
        return lambda: fn(x, *extra)

    return make


def gated_2d(act: str, block: int, warps: int, evict: str = "", store: str = "") -> Impl:
    hints = (f" load:{evict.removeprefix('evict_')}" if evict else "") + (f" store:{store}" if store else "")
    name = f"{act} 2d b{block} w{warps} ({block // (32 * warps)}/thread){hints}"

    def make(case: Case) -> Callable[[], Any]:
        x = case.args[0]
        rows, d = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        per_row = triton.cdiv(d, block)
        grid = (rows * per_row,)

        def fn() -> torch.Tensor:
            _gated_2d_kernel[grid](
                out, x, d, per_row, x.stride(0), out.stride(0),
                ACT=act, BLOCK=block, EVICT=evict, STORE_CACHE=store, num_warps=warps,
            )  # fmt: skip
            return out

        return fn

    return Impl(name, "variant", make, jit=_gated_2d_kernel, applies=_runs_here(act))


def gated_flat(act: str, xblock: int, warps: int) -> Impl:
    def make(case: Case) -> Callable[[], Any]:
        x = case.args[0]
        rows, d = x.shape[0], x.shape[1] // 2
        assert x.is_contiguous() and rows * 2 * d < 2**31, "the flat variant indexes a contiguous x in int32"
        out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        grid = (triton.cdiv(rows * d, xblock),)

        def fn() -> torch.Tensor:
            _gated_flat_kernel[grid](out, x, rows * d, D=d, ACT=act, XBLOCK=xblock, num_warps=warps)
            return out

        return fn

    name = f"{act} flat x{xblock} w{warps} ({xblock // (32 * warps)}/thread, Inductor's shape)"
    return Impl(name, "variant", make, jit=_gated_flat_kernel, applies=_runs_here(act))


def _runs_here(act: str) -> Callable[[Case], bool]:
    """Inline PTX (the ``_ftz`` activations) needs a CUDA device: the interpreter leaves those variants out."""
    return lambda case: not (INTERPRET and act.endswith("_ftz"))


def _norm_args(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool]:
    if case.op == "fused_add_rms_norm":
        x, res, w, eps = case.args
        return x, res, w, eps, True
    x, w, eps = case.args
    return x, x, w, eps, False


def norm_one_pass(
    rows: int, warps: int, evict_x: str = "", evict_w: str = "", late: bool = False, fused_only: bool = False
) -> Impl:
    hints = (f" x:{evict_x.removeprefix('evict_')}" if evict_x else "") + (
        f" w:{evict_w.removeprefix('evict_')}" if evict_w else ""
    )
    name = f"1-pass r{rows} w{warps}{hints}{' res-stored-late' if late else ''}"

    def make(case: Case) -> Callable[[], Any]:
        x, res, w, eps, fused = _norm_args(case)
        n_rows, hidden = x.shape
        assert n_rows * max(x.stride(0), res.stride(0)) < 2**31, "the variant indexes in int32"
        out = torch.empty_like(x)
        block = triton.next_power_of_2(hidden)
        masked = not (block == hidden and n_rows % rows == 0)
        grid = (triton.cdiv(n_rows, rows),)

        def fn() -> torch.Tensor:
            _norm_one_pass_kernel[grid](
                out, x, res, w, n_rows, x.stride(0), res.stride(0), out.stride(0), eps,
                HIDDEN=hidden, BLOCK=block, ROWS=rows, FUSED=fused, MASKED=masked,
                EVICT_X=evict_x, EVICT_W=evict_w, LATE_STORE=late, num_warps=warps,
            )  # fmt: skip
            return out

        return fn

    applies = (lambda case: case.op == "fused_add_rms_norm") if fused_only else (lambda case: True)
    return Impl(name, "variant", make, jit=_norm_one_pass_kernel, applies=applies)


def norm_two_pass(chunk_div: int, warps: int, reload: str = "xr", fused_only: bool = False) -> Impl:
    name = f"2-pass chunk=hidden/{chunk_div} w{warps}" + (f" reload:{reload}" if fused_only or reload != "xr" else "")

    def make(case: Case) -> Callable[[], Any]:
        x, res, w, eps, fused = _norm_args(case)
        n_rows, hidden = x.shape
        chunk = hidden // chunk_div
        assert chunk * chunk_div == hidden and triton.next_power_of_2(chunk) == chunk, "chunks must tile the row"
        out = torch.empty_like(x)

        def fn() -> torch.Tensor:
            _norm_two_pass_kernel[(n_rows,)](
                out, x, res, w, x.stride(0), res.stride(0), out.stride(0), eps,
                HIDDEN=hidden, CHUNK=chunk, FUSED=fused, RELOAD=reload, num_warps=warps,
            )  # fmt: skip
            return out

        return fn

    applies = (lambda case: case.op == "fused_add_rms_norm") if fused_only else (lambda case: True)
    return Impl(name, "variant", make, jit=_norm_two_pass_kernel, applies=applies)


def shipped_norm_impl() -> Impl:
    def make(case: Case) -> Callable[[], Any]:
        fn = getattr(shipped_norm.NormKernels(CUDA), case.op)
        return lambda: fn(*case.args)

    return Impl("shipped (CUDA target)", "shipped", make, jit=shipped_norm._rms_norm_kernel)


def gelu_impls() -> list[Impl]:
    return [
        Impl("shipped (CUDA target, libdevice erf)", "shipped", _shipped_activation("gelu_and_mul"),
             jit=shipped_activation._gated_kernel),
        Impl("floor: shipped silu_and_mul, same bytes", "floor", _shipped_activation("silu_and_mul"),
             reference="silu_and_mul", jit=shipped_activation._gated_kernel),
        Impl("floor: shipped gelu tanh, same bytes", "floor", _shipped_activation("gelu_and_mul", ("tanh",)),
             reference="gelu_and_mul", extra=("tanh",), jit=shipped_activation._gated_kernel),
        gated_2d("gelu_libdevice", 2048, 4),  # the shipped launch, from this file's kernel: the control
        gated_2d("gelu_libdevice", 2048, 8),
        gated_2d("gelu_libdevice", 4096, 8),
        gated_2d("gelu_libdevice", 4096, 4),
        gated_2d("gelu_as", 2048, 4),
        gated_2d("gelu_as", 1024, 4),
        gated_2d("gelu_as", 4096, 4),
        gated_2d("gelu_as_ftz", 2048, 4),
        gated_2d("gelu_as_ftz", 1024, 4),
        gated_2d("gelu_as_ftz", 2048, 8),
        gated_2d("gelu_as_ftz", 4096, 4),
        gated_2d("gelu_as_ftz", 512, 2),
        gated_2d("gelu_as_ftz", 2048, 4, evict="evict_first", store=".cs"),
        gated_2d("gelu_libdevice", 2048, 4, evict="evict_first", store=".cs"),
        gated_flat("gelu_libdevice", 1024, 4),
        gated_flat("gelu_as_ftz", 1024, 4),
        gated_flat("gelu_as_ftz", 2048, 8),
    ]  # fmt: skip


def norm_impls() -> list[Impl]:
    return [
        shipped_norm_impl(),
        norm_one_pass(1, 8),  # the shipped launch with int32 indexing and no column mask
        norm_one_pass(1, 4),
        norm_one_pass(1, 16),
        norm_one_pass(1, 8, evict_w="evict_last"),  # Inductor's hint on the weight alone
        norm_one_pass(1, 8, evict_x="evict_first", evict_w="evict_last"),
        norm_one_pass(1, 8, evict_x="evict_last", evict_w="evict_last"),
        norm_one_pass(1, 8, late=True, fused_only=True),
        norm_one_pass(1, 16, evict_w="evict_last", late=True, fused_only=True),
        norm_one_pass(2, 8),
        norm_one_pass(2, 16),
        norm_one_pass(4, 16),
        norm_two_pass(1, 16, "xr"),  # Inductor's "persistent R0_BLOCK" candidate (predicted winner of its autotune)
        norm_two_pass(2, 16, "xr"),  # Inductor's contiguous candidate (R0_BLOCK 2048, 16 warps)
        norm_two_pass(1, 16, "res", fused_only=True),
        norm_two_pass(2, 8, "res", fused_only=True),
        norm_two_pass(2, 8, "xr"),
        norm_two_pass(1, 8, "xr"),
    ]


def small_impls() -> list[Impl]:
    impls = [
        Impl("shipped via wrapper (CUDA target)", "shipped", _shipped_activation("silu_and_mul"),
             jit=shipped_activation._gated_kernel),
        Impl("shipped kernel, bare JIT launch", "launch", _bare_shipped_silu(compiled=False)),
        Impl("shipped kernel, compiled-kernel launch", "launch", _bare_shipped_silu(compiled=True)),
    ]  # fmt: skip
    for block, warps in ((128, 1), (256, 1), (256, 2), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)):
        impls.append(gated_2d("silu", block, warps))
    impls += [gated_flat("silu", 256, 1), gated_flat("silu", 128, 2), gated_flat("silu", 1024, 4)]
    return impls


def _bare_shipped_silu(compiled: bool) -> Callable[[Case], Callable[[], Any]]:
    """The shipped gated kernel with the wrapper's launch choices worked out once: what a launch costs without it."""

    def make(case: Case) -> Callable[[], Any]:
        x = case.args[0]
        rows, d = x.shape[0], x.shape[1] // 2
        out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
        block = min(CUDA.elementwise_block, triton.next_power_of_2(d))
        per_thread = shipped_activation._ELEMENTS_PER_THREAD["silu"]
        warps = max(1, min(CUDA.max_warps, block // (CUDA.warp_size * per_thread)))
        per_row = triton.cdiv(d, block)
        grid = (rows * per_row,)
        kernel = shipped_activation._gated_kernel
        args = (out, x, d, per_row, x.stride(0), out.stride(0))

        def jit_launch() -> torch.Tensor:
            kernel[grid](*args, ACTIVATION="silu", BLOCK=block, num_warps=warps)
            return out

        if not compiled or INTERPRET:
            return jit_launch
        compiled_kernel = kernel[grid](*args, ACTIVATION="silu", BLOCK=block, num_warps=warps)
        runner = compiled_kernel[grid]

        def raw_launch() -> torch.Tensor:
            runner(*args, "silu", block)  # every parameter in order, constexprs included (the launcher skips them)
            return out

        return raw_launch

    return make


# ---------------------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------------------


def make_case(section: str, op: str, tokens: int, device: torch.device, tiny: bool) -> Case:
    if not tiny:
        work = workload(op, tokens, DTYPE, device)  # bench ops' inputs, seeded alike
        args, nbytes = work.args, work.nbytes
    else:  # widths that cross tile edges in the interpreter (1000 is no power of two; 5 rows leave a tail)
        gen = torch.Generator(device).manual_seed(tokens)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device=device).to(DTYPE)

        hidden, inter = 256, 1000
        if op in ("silu_and_mul", "gelu_and_mul"):
            args, nbytes = (rand(tokens, 2 * inter),), 3 * tokens * inter * 2
        elif op == "rms_norm":
            args, nbytes = (rand(tokens, hidden), 1 + 0.1 * rand(hidden), 1e-6), 2 * tokens * hidden * 2
        else:
            args, nbytes = (
                (rand(tokens, hidden), rand(tokens, hidden), 1 + 0.1 * rand(hidden), 1e-6),
                4 * tokens * hidden * 2,
            )
    residual0 = args[1].clone() if op == "fused_add_rms_norm" else None
    return Case(section, op, tokens, args, nbytes, residual0)


SECTIONS = {
    "gelu": ([("gelu_and_mul", 16384), ("gelu_and_mul", 32768)], [("gelu_and_mul", 3)], gelu_impls),
    "norm": (
        [("fused_add_rms_norm", 4096), ("fused_add_rms_norm", 16384), ("rms_norm", 1024)],
        [("fused_add_rms_norm", 5), ("rms_norm", 5)],
        norm_impls,
    ),
    "small": ([("silu_and_mul", 1), ("silu_and_mul", 16)], [("silu_and_mul", 1), ("silu_and_mul", 3)], small_impls),
}


# ---------------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------------


def erf_section(device: torch.device, tiny: bool) -> list[dict[str, Any]]:
    """Largest error of each formulation over a dense grid, in float32 as the kernels compute it, against float64."""
    n = 1 << (14 if tiny else 24)
    rows = []
    for what, lo, hi, methods in (
        ("erf", -6.0, 6.0, ("libdevice", "as")),
        ("gelu", -12.0, 12.0, ("libdevice", "as", "tanh") if tiny else ("libdevice", "as", "as_ftz", "tanh")),
    ):
        grid_in = torch.linspace(lo, hi, n, dtype=torch.float32, device=device)
        exact = torch.erf(grid_in.double()) if what == "erf" else F.gelu(grid_in.double())
        for method in methods:
            out = torch.empty_like(grid_in)
            _erf_grid_kernel[(triton.cdiv(n, 1024),)](out, grid_in, n, WHAT=what, METHOD=method, BLOCK=1024)
            err = (out.double() - exact).abs()
            fp32_bound = 1e-5 + 1e-5 * exact.abs()  # gelu_and_mul's float32 tolerance (atol, rtol)
            big = exact.abs() >= 1e-3
            row = {
                "section": "erf", "what": what, "method": method, "points": n, "range": [lo, hi],
                "max_abs": float(err.max()), "max_rel_where_abs_ge_1e-3": float((err[big] / exact[big].abs()).max()),
                "worst_at": float(grid_in[int(err.argmax())]), "max_over_fp32_tolerance": float((err / fp32_bound).max()),
            }  # fmt: skip
            rows.append(row)
            print(
                f"erf    {what:<5} {method:<10} max abs {row['max_abs']:.3e} at {row['worst_at']:+.3f}  "
                f"max rel (|y|>=1e-3) {row['max_rel_where_abs_ge_1e-3']:.3e}  "
                f"max err / fp32 tolerance {row['max_over_fp32_tolerance']:.3f}",
                flush=True,
            )
    return rows


def _fmt_row(row: dict[str, Any]) -> str:
    head = f"{row['section']:<6} {row['case']:<24} {row['impl']:<52}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    if "error" in row:
        return f"{head} error: {row['error'][:120]}"
    err = f"err {row['max_err']:.2e} {'ok ' if row['ok'] else 'BAD'}" if "max_err" in row else " " * 16
    if not row.get("ok", True):
        return f"{head} {err} not timed: {'; '.join(row['why'])[:140]}"
    parts = [head, err]
    for mode in ("graph", "cold"):
        if f"{mode}_us" in row:
            versus = row.get(f"{mode}_x_inductor")
            parts.append(
                f"| {mode} {row[f'{mode}_us']:8.1f} us {row.get(f'{mode}_of_copy', math.nan):6.1%} "
                + (f"{versus:5.2f}x" if versus is not None else "    -")
            )
    if "host_us" in row:
        parts.append(f"| host {row['host_us']:5.1f} us")
    if "n_regs" in row:
        parts.append(f"| regs {row['n_regs']} spills {row.get('n_spills', '?')}")
    if row.get("config"):
        parts.append(f"| {row['config']}")
    return " ".join(parts)


def run_case(
    case: Case, impls: list[Impl], timer: Timer, budget: Budget, tiny: bool, host: bool
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base = {"section": case.section, "case": case.label, "op": case.op, "tokens": case.tokens, "nbytes": case.nbytes}
    copy_times: dict[str, float] = {}
    inductor: dict[str, float] = {}
    if not tiny:
        src = torch.randn(max(1, case.nbytes // 4), device=case.args[0].device, dtype=DTYPE)
        dst = torch.empty_like(src)
        copy_times = {
            "graph": timer.graph_us(lambda: dst.copy_(src), case.nbytes),
            "cold": timer.cold_us(lambda: dst.copy_(src)),
        }
        row = {**base, "impl": "copy (same bytes)", "kind": "copy", **{f"{k}_us": v for k, v in copy_times.items()}}
        row.update({f"{k}_of_copy": 1.0 for k in copy_times})
        rows.append(row)
        print(_fmt_row(row), flush=True)
        del src, dst
    for impl in impls:
        if not impl.applies(case):
            continue
        row = {**base, "impl": impl.name, "kind": impl.kind}
        if budget.spent():
            row["skipped"] = f"budget of {budget.seconds:.0f} s spent"
            rows.append(row)
            print(_fmt_row(row), flush=True)
            continue
        try:
            before = _kernel_cache(impl.jit) if impl.jit is not None else {}
            fn = impl.make(case)
            verdict = check(case, impl, fn)
            if impl.jit is not None:
                new = [k for i, k in _kernel_cache(impl.jit).items() if i not in before]
                if new:
                    _COMPILED[impl.name] = new[-1]
            row.update(
                ok=verdict["ok"], why=verdict["why"], max_err=verdict["out"]["max"], mean_err=verdict["out"]["mean"]
            )
            if "residual" in verdict:
                row.update(residual_max_err=verdict["residual"]["max"])
            kernel = _COMPILED.get(impl.name)
            if kernel is not None and not isinstance(kernel, list):
                row.update(_compiled_info(kernel))
            if impl.kind == "inductor":
                row["config"] = _INDUCTOR_KEPT.get(case.label, "?")
            if verdict["ok"] and not tiny:
                row["graph_us"] = timer.graph_us(fn, case.nbytes)
                row["cold_us"] = timer.cold_us(fn)
                if host:
                    row["host_us"] = timer.host_us(fn)
                if impl.kind == "inductor":
                    inductor = {"graph": row["graph_us"], "cold": row["cold_us"]}
                for mode in ("graph", "cold"):
                    row[f"{mode}_of_copy"] = copy_times[mode] / row[f"{mode}_us"]
                    if mode in inductor:
                        row[f"{mode}_x_inductor"] = inductor[mode] / row[f"{mode}_us"]
            del fn
        except Exception as exc:  # one variant that fails to compile or run must not end the probe
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(_fmt_row(row), flush=True)
        case.restore()
    return rows


def _dump_case_asm(case: Case, rows: list[dict[str, Any]], asm_dir: Path) -> dict[str, list[str]]:
    """PTX/SASS of the shipped kernel, Inductor's kernels and the case's fastest checked variant (graph replay)."""
    timed = [r for r in rows if r.get("graph_us") and r["kind"] == "variant"]
    picks = {"shipped": next((r["impl"] for r in rows if r["kind"] == "shipped"), None)}
    if timed:
        picks["best-variant"] = min(timed, key=lambda r: r["graph_us"])["impl"]
    written: dict[str, list[str]] = {}
    stem = f"{case.op}-{case.tokens}"
    for role, name in picks.items():
        kernel = _COMPILED.get(name) if name else None
        if kernel is not None and not isinstance(kernel, list):
            written[f"{role}: {name}"] = _dump_asm(kernel.asm, asm_dir / f"{stem}-{role}")
    for i, (binary, cache_hash) in enumerate(_COMPILED.get("inductor " + case.label, [])):
        try:
            asm = binary.asm if binary is not None else _cached_asm(cache_hash) if cache_hash else None
        except Exception as exc:  # the cache layout is Inductor's and Triton's business: best effort
            asm = {"ptx": f"// not found: {type(exc).__name__}: {exc}", "sass": ""}
        if asm is not None:
            written[f"inductor kernel {i}"] = _dump_asm(asm, asm_dir / f"{stem}-inductor{i}")
    return written


def _round_like_gpus() -> None:
    """Make the interpreter round float32 -> bfloat16 to nearest even as GPUs do (it truncates), with the patch the
    Triton tests use (core/tests/triton/conftest.py): the precision statistics would otherwise judge the interpreter."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "core" / "tests" / "triton" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_triton_tests_conftest", path)
    if spec is None or spec.loader is None or not path.exists():
        raise SystemExit(f"error: {path} is missing; --tiny needs its bfloat16 rounding patch for the interpreter")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.INTERPRETER_ROUNDS_LIKE_GPUS:
        raise SystemExit("error: this Triton's interpreter could not be patched to round bfloat16 like GPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton interpreter, tiny shapes: correctness only")
    parser.add_argument("--sections", default="erf,gelu,norm,small", help="comma list of erf, gelu, norm, small")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for Inductor's code, asm, JSON")
    parser.add_argument("--json", default=None, help="JSON path (default OUT/probe-rowwise.json)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip what would start after this many seconds")
    parser.add_argument("--no-inductor", action="store_true", help="leave Inductor out (saves its compile time)")
    parser.add_argument("--no-asm", action="store_true", help="do not write PTX/SASS")
    args = parser.parse_args(argv)

    budget = Budget(args.budget_s)
    tiny = args.tiny
    if tiny and not INTERPRET:
        print(
            "error: --tiny runs in Triton's interpreter; run it as TRITON_INTERPRET=1 python3 dev/experiments/probe_rowwise.py --tiny"
        )
        return 2
    if not tiny and not torch.cuda.is_available():
        print(
            "error: no CUDA device; on a CPU run the correctness pass: TRITON_INTERPRET=1 python3 dev/experiments/probe_rowwise.py --tiny"
        )
        return 2
    if tiny:
        _round_like_gpus()
        # numpy's exp overflows to inf for large negative gates (silu, tanh GELU), as the GPU's does: the result is right
        warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
    device = torch.device("cpu" if tiny else "cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out_dir / "probe-rowwise.json"
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - {"erf", *SECTIONS}
    if unknown:
        print(f"error: unknown section(s) {sorted(unknown)}; choose from erf, {', '.join(SECTIONS)}")
        return 2

    timer = Timer(device)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not tiny else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(DTYPE).removeprefix("torch."),
        "tiny": tiny,
        "budget_s": args.budget_s,
        "erf": [],
        "rows": [],
        "inductor": {},
        "asm": {},
        "section_seconds": {},
    }
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['dtype']}", flush=True)
    print("graph: CUDA-graph replay, warm L2 (bench ops); cold: do_bench, L2 flushed; % of a copy of the same bytes; "
          "xInd: Inductor's time / this (> 1 faster)", flush=True)  # fmt: skip
    for section in sections:
        started = budget.elapsed()
        if section == "erf":
            result["erf"] = erf_section(device, tiny)
        else:
            gpu_cases, tiny_cases, impls_of = SECTIONS[section]
            for op, tokens in tiny_cases if tiny else gpu_cases:
                case_label = f"{op} {tokens}"
                if budget.spent():
                    row = {"section": section, "case": case_label, "impl": "(whole case)", "skipped": "budget spent"}
                    result["rows"].append(row)
                    print(_fmt_row(row), flush=True)
                    continue
                case = make_case(section, op, tokens, device, tiny)
                impls = impls_of()
                if not tiny and not args.no_inductor:
                    impls.insert(0, inductor_impl(out_dir, result["inductor"]))
                rows = run_case(case, impls, timer, budget, tiny, host=section == "small")
                result["rows"] += rows
                if not tiny and not args.no_asm:
                    result["asm"][case.label] = _dump_case_asm(case, rows, out_dir / "asm")
                del case
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        result["section_seconds"][section] = round(budget.elapsed() - started, 1)
        print(f"-- {section}: {result['section_seconds'][section]:.1f} s (total {budget.elapsed():.1f} s)", flush=True)
        json_path.write_text(json.dumps(result, indent=1, default=str))
    _summary(result)
    json_path.write_text(json.dumps(result, indent=1, default=str))
    bad = [r for r in result["rows"] if r.get("ok") is False or "error" in r]
    print(f"wrote {json_path}; {len(bad)} implementation(s) wrong or failing", flush=True)
    return 1 if tiny and bad else 0


def _summary(result: dict[str, Any]) -> None:
    """Per case: the shipped kernel, Inductor and the fastest correct variant, by graph replay and by cold do_bench."""
    if result["tiny"]:
        checked = [r for r in result["rows"] if "ok" in r]
        print(f"\ntiny: {sum(r['ok'] for r in checked)} of {len(checked)} implementations match float64 within the "
              "contract", flush=True)  # fmt: skip
        return
    print("\nsummary (graph | cold): time, % of copy, x Inductor", flush=True)
    for label in dict.fromkeys(r["case"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["case"] == label and r.get("graph_us")]
        if not rows:
            continue
        for who, pick in (
            ("shipped", [r for r in rows if r["kind"] == "shipped"]),
            ("inductor", [r for r in rows if r["kind"] == "inductor"]),
            (
                "best variant (graph)",
                sorted((r for r in rows if r["kind"] == "variant"), key=lambda r: r["graph_us"])[:1],
            ),
            (
                "best variant (cold)",
                sorted((r for r in rows if r["kind"] == "variant"), key=lambda r: r["cold_us"])[:1],
            ),
        ):
            for r in pick[:1]:
                cells = " | ".join(
                    f"{r[f'{m}_us']:8.1f} us {r[f'{m}_of_copy']:6.1%} {r.get(f'{m}_x_inductor', math.nan):5.2f}x"
                    for m in ("graph", "cold")
                )
                print(f"  {label:<24} {who:<22} {cells}  {r['impl']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
