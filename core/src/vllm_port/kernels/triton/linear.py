"""``linear`` for skinny inputs (decode): a split-K matrix product that streams the weight once.

At decode every ``linear`` multiplies a few rows (1 to 16 tokens) by a weight of megabytes: the
weight's bytes are the whole cost, and a BLAS tuned for square products leaves bandwidth unused. Here
each program computes ``BLOCK_N`` output features for *all* rows (padded to a power of two), so
every weight byte is read once; when ``N / BLOCK_N`` programs would not fill the device, the
reduction over ``K`` is split across programs too (:func:`_splits`). Each split writes float32
partial sums ``[SPLIT_K, M, N]`` and counts itself in on its block of outputs; the last to arrive
adds every split's partials in split order, with the bias and the rounding to the output dtype, and
resets the count for the next call. One launch (no reduction kernel, whose launch costs a decode
step more than its work), and results are the same from run to run whichever split arrives last.
One row multiplies on vector units (``linear_fma`` tiles: products summed per thread, reduced across
threads once at the end); more rows go through ``tl.dot`` on tensor cores (``linear_dot``), padded to
its 16-row minimum (the padding costs compute, which is idle here, not bandwidth).

The weight is read through its strides: ``[N, K]`` row-major (``nn.Linear``) is read along ``K``,
a transposed view (``[K, N]`` storage) along ``N``, both in wide coalesced loads. Inputs with more
rows than ``linear_max_rows``, weights with no unit stride, and float64 go to ``F.linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...device_properties import compute_units
from ...ops import BindContext
from ...ops.linear import check_linear, packed_rows
from ..triton_target import LinearTiles, TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["LinearKernels"]

#: dtypes the kernel serves; float64 (allowed by the contract's checks, claimed by no provider) goes to torch.
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Fewest reduction steps (``BLOCK_K`` tiles) one split keeps: fewer leave the load pipeline no room
#: to fill, and cost more partial sums than they save.
_MIN_TILES_PER_SPLIT = 2
#: Most splits: bounds the float32 partial sums (``SPLIT_K x M x N``) and the reduction's reads.
_MAX_SPLITS = 32
#: Blocks of outputs one device's arrival counts cover (256 KiB of int32); more blocks than this never
#: split (``_splits`` splits only below ``waves x multiprocessors`` blocks, far fewer).
_COUNTS = 1 << 16
#: ``tl.dot``'s smallest operand edge.
_DOT_MIN = 16
#: Multiprocessors the CPU interpreter pretends to have, so that small test shapes split the reduction.
_INTERPRETER_SMS = 4


@cached_launch
@triton.jit(do_not_specialize=["M"])  # one compiled variant per row padding, whatever the row count
def _skinny_linear_kernel(
    out_ptr,  # [M, N], x's dtype, contiguous
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT only)
    count_ptr,  # [>= N / BLOCK_N] int32 arrivals per block of outputs, 0 between calls (SPLIT only)
    x_ptr,  # [M, K], any strides
    w_ptr,  # [N, K], any strides (a transposed view has stride_wn == 1)
    b_ptr,  # [N] bias, read only with HAS_BIAS
    s_ptr,  # float32 weight scale: [] per tensor or [N] per output (SCALE only; fp8_linear's e4m3 weights)
    M,
    N,
    K,
    k_per_split,  # input features per split: a multiple of BLOCK_K
    split_k,  # programs sharing one block of outputs' reduction
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_b,
    BLOCK_M: tl.constexpr,  # rows, padded to a power of two: >= 16 with USE_DOT, else 1
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no tile needs a mask
    SPLIT: tl.constexpr,  # split_k > 1: partial sums, the last split to arrive finishes
    HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr,  # the weight's scale multiplies the product: 0 none, 1 per tensor, 2 per output
    USE_DOT: tl.constexpr,  # tensor cores (tl.dot); else one row on vector units
    DOT_FP32: tl.constexpr,  # upcast tl.dot's 16-bit operands (the CPU interpreter's dot needs it)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32: TF32 would miss float32's tolerance
):
    """``out[:, n-block] = x[:, k-range] @ w[n-block, k-range].T`` for one block of outputs and one split.

    Program ``(pid_n, pid_k)`` covers outputs ``[pid_n * BLOCK_N, +BLOCK_N)`` and input features
    ``[pid_k * k_per_split, +k_per_split)``. Rows and outputs past ``M`` and ``N`` are computed from
    wrapped indices (valid memory, no masks in the loop) and never stored. The weight is streamed
    once (``evict_first``: it will not be read again before the other layers' weights evict it).
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # int64 offsets: a vocabulary-sized weight (or its transpose) passes 2**31 elements
    k_offs = (k_lo + ks).to(tl.int64)
    w_ptrs = w_ptr + k_offs[:, None] * stride_wk + (cols % N).to(tl.int64)[None, :] * stride_wn  # [BLOCK_K, BLOCK_N]
    if USE_DOT:
        x_ptrs = x_ptr + (rows % M).to(tl.int64)[:, None] * stride_xm + k_offs[None, :] * stride_xk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                k_ok = k + ks < K
                x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0, eviction_policy="evict_first")
            if DOT_FP32:
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
    else:
        # One row, as a column beside the weight tile: each thread sums its own products and the
        # threads sharing an output reduce once, after the loop (no shuffles per step).
        x_ptrs = x_ptr + k_offs[:, None] * stride_xk  # [BLOCK_K, 1]
        partial = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for k in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                k_ok = (k + ks < K)[:, None]
                x = tl.load(x_ptrs, mask=k_ok, other=0.0)
                w = tl.load(w_ptrs, mask=k_ok, other=0.0, eviction_policy="evict_first")
            partial += w.to(tl.float32) * x.to(tl.float32)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        acc = tl.sum(partial, axis=0)[None, :]  # [1, BLOCK_N]

    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials written before the arrival publishes them
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # the last split: all partials are in, whichever order they came
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(split_k):  # split order, so the sum rounds the same on every run
                acc += tl.load(part_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            acc = _scaled(acc, s_ptr, cols, N, SCALE)
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols * stride_b, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offsets, acc, mask=mask)  # rounded once, to out's dtype
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call
    else:
        acc = _scaled(acc, s_ptr, cols, N, SCALE)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols * stride_b, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offsets, acc, mask=mask)  # rounded once, to out's dtype


@triton.jit
def _scaled(acc, s_ptr, cols, N, SCALE: tl.constexpr):
    """``acc`` times the weight's scale (``SCALE`` 1: one for the tensor, 2: one per output; 0: as it is)."""
    if SCALE == 1:
        acc = acc * tl.load(s_ptr)
    elif SCALE == 2:
        acc = acc * tl.load(s_ptr + cols % N)[None, :]  # outputs past N wrap, as the weight's rows do
    return acc


def _splits(n_blocks: int, k_tiles: int, num_sms: int, waves: int) -> tuple[int, int]:
    """``(split_k, tiles_per_split)``: how to share ``k_tiles`` reduction steps among programs.

    No split while ``n_blocks`` programs give every multiprocessor ``waves`` or more (or ``waves``
    is 0); otherwise as many splits as reach that, each of at least ``_MIN_TILES_PER_SPLIT`` tiles,
    none empty.
    """
    wanted = waves * num_sms
    if n_blocks >= wanted or k_tiles < 2 * _MIN_TILES_PER_SPLIT:
        return 1, k_tiles
    split = min(cdiv(wanted, n_blocks), k_tiles // _MIN_TILES_PER_SPLIT, _MAX_SPLITS)
    tiles = cdiv(k_tiles, split)
    return cdiv(k_tiles, tiles), tiles


_arrival_counts: dict[torch.device, torch.Tensor] = {}


def _counts_for(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counts (zeros between calls: the last split of a block resets its count), or
    None while a CUDA graph is being captured before the device's first split call: a buffer made then
    would be zeroed only when the graph replays. Calls on one device share them, so splits must not run
    on two streams of a device at once (an engine's forward runs on one).
    """
    counts = _arrival_counts.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _arrival_counts[device] = torch.zeros(_COUNTS, dtype=torch.int32, device=device)
    return counts


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, in_features]``: a view where the strides allow, else a copy (a few rows: cheap)."""
    return x.reshape(-1, x.shape[-1])


class LinearKernels:
    """The Triton provider of ``linear`` for inputs of at most ``target.linear_max_rows`` rows."""

    OPS = ("linear",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def supports(self, ctx: BindContext) -> bool:
        """Bind-time predicate: the target enables the kernel (ROCm and XPU keep their BLAS until measured)."""
        return self.target.linear_max_rows > 0

    def serves(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """Whether the kernel takes this call (checked arguments); ``linear`` hands the rest to ``F.linear``.

        Served: 1 to ``linear_max_rows`` rows (the product of ``x``'s leading dimensions), at least one
        input and output feature, bfloat16/float16/float32, a weight of at most ``linear_max_weight_bytes``
        (where the target caps it) with a unit stride (rows or columns contiguous) so that its loads coalesce.
        """
        n, k = weight.shape
        rows = math.prod(x.shape[:-1])
        cap = self.target.linear_max_weight_bytes
        return (
            0 < rows <= self.target.linear_max_rows
            and n > 0
            and k > 0
            and x.dtype in _DTYPES
            and 1 in weight.stride()
            and (cap == 0 or n * k * weight.element_size() <= cap)
        )

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` (see :func:`vllm_port.ops.linear.linear_reference`)."""
        check_linear(x, weight, bias)
        if not self.serves(x, weight, bias):
            return F.linear(packed_rows(x), weight, bias).contiguous()
        return self._launch(x, weight, bias)

    def _launch(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        split_k: int | None = None,
        *,
        weight_scale: torch.Tensor | None = None,
        one_row: LinearTiles | None = None,
    ) -> torch.Tensor:
        """Run the kernel; ``split_k`` forces a split count (tests), else :func:`_splits` chooses.

        ``weight_scale`` (float32, one value or one per output) multiplies the product: ``fp8_linear``'s
        one-row path, an e4m3 weight widened in registers. ``one_row`` replaces the target's
        ``linear_fma`` tiles for a single row.
        """
        n, k = weight.shape
        x2 = _rows_view(x)
        m = x2.shape[0]
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
        fma_tiles = one_row or self.target.linear_fma
        use_dot = m > 1 or fma_tiles is None
        tiles: LinearTiles = self.target.linear_dot if use_dot else fma_tiles
        block_m, block_n = 1, tiles.block_n
        if use_dot:
            block_m, block_n = max(_DOT_MIN, next_power_of_2(m)), max(_DOT_MIN, block_n)
        n_blocks, k_tiles = cdiv(n, block_n), cdiv(k, tiles.block_k)
        if split_k is None:
            split_k, tiles_per_split = _splits(
                n_blocks, k_tiles, compute_units(x.device, _INTERPRETER_SMS), tiles.waves
            )
        else:
            tiles_per_split = cdiv(k_tiles, split_k)
            split_k = cdiv(k_tiles, tiles_per_split)
        counts = _counts_for(x.device) if split_k > 1 and n_blocks <= _COUNTS else None
        if counts is None:  # no split, or no counts to reduce splits with
            split_k, tiles_per_split = 1, k_tiles
        split = split_k > 1
        partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split else out
        dot_fp32 = use_dot and x.device.type == "cpu" and x.dtype != torch.float32
        bias_arg = bias if bias is not None else x2  # a placeholder pointer when there is no bias
        scale_kind = 0 if weight_scale is None else 1 if weight_scale.numel() == 1 else 2
        scale_arg = weight_scale.reshape(-1) if weight_scale is not None else x2
        _skinny_linear_kernel[(n_blocks, split_k)](
            out, partials, counts if counts is not None else out, x2, weight, bias_arg, scale_arg,
            m, n, k, tiles_per_split * tiles.block_k, split_k,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            bias.stride(0) if bias is not None else 0,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=tiles.block_k,
            EVEN_K=k % tiles.block_k == 0,
            SPLIT=split,
            HAS_BIAS=bias is not None,
            SCALE=scale_kind,
            USE_DOT=use_dot,
            DOT_FP32=dot_fp32,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 or dot_fp32 else None,
            num_warps=tiles.warps,
            num_stages=tiles.stages,
        )  # fmt: skip
        return out
