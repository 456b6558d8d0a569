"""``fused_moe`` as two grouped GEMMs over (token, expert) pairs sorted by expert.

Routing is the contract's (:func:`vllm_port.ops.moe.route`, a few torch ops). The launcher then
sorts the ``tokens x top_k`` pairs by expert and pads each expert's run of pairs to a multiple of
``block_m`` (torch ops on the device, no host read: the grid is sized by the most padding there can
be, and programs past the padded total return at once). A decode step's few pairs are routed and
sorted in one Triton program instead (:func:`_route_small_kernel`, the same experts bit for bit).
Every ``block_m`` rows of the padded order belong to one expert, so a program reads one expert's
weight tiles:

1. :func:`_gate_up_kernel`: for a block of pairs and a block of intermediate columns, the gate and
   up products ``x[token] @ w13[e, cols].T`` and ``x[token] @ w13[e, I + cols].T`` in two float32
   accumulators, then ``act(gate) * up`` (each rounded to the dtype as the reference rounds), stored
   by pair: ``a [pairs, intermediate]``;
2. :func:`_down_kernel`: ``a[pair] @ w2[e, cols].T`` for a block of hidden columns, rounded to the
   dtype, times the pair's routing weight, stored by pair in float32.

The ``top_k`` rows of a token are then summed in float32 (and the shared experts added: the same
kernels with one expert that every token chooses with weight 1) and rounded once
(:func:`_combine_kernel`). At decode each
active expert's weights are read once by ``cdiv(intermediate, block_n)`` (then ``cdiv(hidden,
block_n)``) programs; at prefill the same kernels are a grouped GEMM of wide tiles
(``TritonTarget.moe_small`` / ``moe_large``). Float32 inputs multiply in IEEE float32 (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.moe import check_fused_moe, route
from ..triton_target import MoeTiles, TritonTarget
from .activation import _gelu_erf
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["MoeKernels", "route_and_sort", "sort_pairs_by_expert"]


@triton.jit
def _act(g, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return g / (1.0 + tl.exp(-g))
    elif ACTIVATION == "gelu":
        return _gelu_erf(g)
    else:  # gelu_tanh: 0.5 (1 + tanh z) == sigmoid(2 z)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * z))


@cached_launch
@triton.jit
def _gate_up_kernel(
    a_ptr, x_ptr, w_ptr, pairs_ptr, block_expert_ptr, padded_total_ptr,
    inter, hidden, top_k, num_pairs,
    x_stride_t, x_stride_h, w_stride_e, w_stride_n, w_stride_k, a_stride_p,
    ACTIVATION: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``a[pair, cols] = act(x[t] @ w13[e, cols].T) * (x[t] @ w13[e, inter + cols].T)`` for one block of pairs.

    Args:
        a_ptr: output ``[num_pairs, inter]`` in ``x``'s dtype, rows ``a_stride_p`` apart.
        x_ptr: tokens ``[tokens, hidden]`` (any strides).
        w_ptr: ``w13 [experts, 2 * inter, hidden]`` (any strides).
        pairs_ptr: the padded expert order: pair ids (``token * top_k + slot``), ``num_pairs`` as padding.
        block_expert_ptr: the expert of each block of ``BLOCK_M`` padded rows.
        padded_total_ptr: one int: rows of the padded order in use (programs past it return).
        ACTIVATION: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"``. PRECISION: ``tl.dot``'s input precision.
        DOT_FP32: upcast 16-bit operands before ``tl.dot`` (the CPU interpreter's dot multiplies bfloat16
            bit patterns as integers; exact, as products are summed in float32 anyway).
    """
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
        return
    dtype = x_ptr.dtype.element_ty
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    token = tl.where(valid, pair // top_k, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * x_stride_t
    gate_cols = w_ptr + expert * w_stride_e + cols[None, :] * w_stride_n
    up_cols = gate_cols + inter * w_stride_n
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        xt = tl.load(x_rows + k[None, :] * x_stride_h, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wg = tl.load(gate_cols + k[:, None] * w_stride_k, mask=w_mask, other=0.0)
        wu = tl.load(up_cols + k[:, None] * w_stride_k, mask=w_mask, other=0.0)
        if DOT_FP32:
            xt, wg, wu = xt.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(xt, wg, gate, input_precision=PRECISION)
        up = tl.dot(xt, wu, up, input_precision=PRECISION)
    # the reference's roundings: each product to the dtype, the activation to the dtype, then the product
    act = _act(gate.to(dtype).to(tl.float32), ACTIVATION).to(dtype).to(tl.float32)
    out = act * up.to(dtype).to(tl.float32)
    tl.store(a_ptr + pair[:, None] * a_stride_p + cols[None, :], out.to(dtype), mask=valid[:, None] & col_ok[None, :])


@cached_launch
@triton.jit
def _down_kernel(
    out_ptr, a_ptr, w_ptr, pairs_ptr, block_expert_ptr, padded_total_ptr, weights_ptr,
    hidden, inter, num_pairs,
    a_stride_p, w_stride_e, w_stride_n, w_stride_k, out_stride_p,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``out[pair, cols] = weight[pair] * round(a[pair] @ w2[e, cols].T)`` in float32, for one block of pairs.

    Args:
        out_ptr: float32 ``[num_pairs, hidden]``, rows ``out_stride_p`` apart.
        a_ptr: the gate/up kernel's output ``[num_pairs, inter]``.
        w_ptr: ``w2 [experts, hidden, inter]`` (any strides).
        weights_ptr: float32 routing weight of each pair.
        The rest as :func:`_gate_up_kernel`.
    """
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(padded_total_ptr):
        return
    dtype = a_ptr.dtype.element_ty
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    safe = tl.where(valid, pair, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + safe[:, None] * a_stride_p
    w_cols = w_ptr + expert * w_stride_e + cols[None, :] * w_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_ok = k < inter
        at = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(w_cols + k[:, None] * w_stride_k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:
            at, wt = at.to(tl.float32), wt.to(tl.float32)
        acc = tl.dot(at, wt, acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + safe, mask=valid, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * out_stride_p + cols[None, :], y, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _sort_small(
    ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, num_pairs, num_experts, rows, num_blocks,
    P: tl.constexpr, E: tl.constexpr, R: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """:func:`sort_pairs_by_expert` in one program, for a decode step's few pairs (one launch, not twenty).

    ``P``, ``E``, ``R``, ``B``: powers of two at least the pairs, experts, padded rows and blocks. Pair ``i``
    goes to its expert's padded start plus the number of earlier pairs of that expert (a stable order).
    ``ids_ptr``: the pairs' experts, contiguous.
    """
    i = tl.arange(0, P)
    valid = i < num_pairs
    ids = tl.load(ids_ptr + i, mask=valid, other=-1)  # -1: no expert
    onehot = (ids[:, None] == tl.arange(0, E)[None, :]).to(tl.int32)  # [P, E]
    counts = tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs before i of each expert
    rank = tl.sum(earlier * onehot, axis=1)
    start = tl.sum((end - padded)[None, :] * onehot, axis=1)
    r = tl.arange(0, R)
    tl.store(pairs_ptr + r, tl.full((R,), 0, tl.int64) + num_pairs, mask=r < rows)
    tl.debug_barrier()  # the padding first, then the pairs over it
    tl.store(pairs_ptr + start + rank, i.to(tl.int64), mask=valid)
    b = tl.arange(0, B)
    first_row = (b * BLOCK_M)[:, None]
    experts_before = tl.sum((end[None, :] <= first_row).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.minimum(experts_before, num_experts - 1).to(tl.int64), mask=b < num_blocks)
    tl.store(total_ptr, tl.sum(padded, axis=0).to(tl.int64))


@cached_launch
@triton.jit
def _align_small_kernel(
    ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, num_pairs, num_experts, rows, num_blocks,
    P: tl.constexpr, E: tl.constexpr, R: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """:func:`_sort_small` as a kernel of its own (ids routed by torch ops, or the shared experts' zeros)."""
    _sort_small(ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, num_pairs, num_experts, rows, num_blocks,
                P, E, R, B, BLOCK_M)  # fmt: skip


@cached_launch
@triton.jit
def _route_small_kernel(
    logits_ptr, weights_ptr, ids_ptr, pairs_ptr, block_expert_ptr, total_ptr,
    tokens, num_experts, top_k, logit_stride_t, logit_stride_e, routed_scaling, rows, num_blocks,
    SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, T: tl.constexpr, K: tl.constexpr,
    P: tl.constexpr, E: tl.constexpr, R: tl.constexpr, B: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """:func:`vllm_port.ops.moe.route`, then :func:`_sort_small`, in one program (a decode step's routing).

    The choice is exact, as the contract asks: each of the ``top_k`` rounds takes the largest logit
    left, the lower expert index among equal ones, through an integer key that orders float32 as the
    stable sort does (``-0.0`` equal to ``0.0``, NaN above everything). The weights are the scores of the
    chosen experts (softmax over all, or sigmoid), renormalised and scaled as ``route`` does, in float32.

    Args:
        logits_ptr: ``[tokens, num_experts]`` router logits (16- or 32-bit floats, any strides).
        weights_ptr, ids_ptr: outputs ``[tokens, top_k]`` float32 and int64, contiguous.
        T, K: powers of two at least ``tokens`` and ``top_k``; the rest as :func:`_sort_small`.
    """
    t = tl.arange(0, T)
    e = tl.arange(0, E)
    row_ok = (t < tokens)[:, None]
    ok = row_ok & (e < num_experts)[None, :]
    logits = tl.load(logits_ptr + t[:, None] * logit_stride_t + e[None, :] * logit_stride_e, mask=ok, other=0.0)
    logits = logits.to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        top = tl.max(tl.where(ok, logits, float("-inf")), axis=1)
        p = tl.where(ok, tl.exp(logits - top[:, None]), 0.0)
        scores = p / tl.where(row_ok, tl.sum(p, axis=1)[:, None], 1.0)  # rows past the tokens: no 0 / 0
    bits = tl.where(logits == 0.0, 0.0, logits).to(tl.int32, bitcast=True)  # -0.0 sorts as 0.0
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # the floats' order, as integers
    key = tl.where(logits != logits, 0x7FFFFFFF, key)  # NaN first, as the descending sort puts it
    key = tl.where(ok, key, -0x80000000)  # below every float: never chosen
    slot = tl.arange(0, K)[None, :]
    ids = tl.zeros((T, K), dtype=tl.int32)
    weights = tl.zeros((T, K), dtype=tl.float32)
    for j in range(top_k):
        best = tl.argmax(key, axis=1, tie_break_left=True)
        chosen = e[None, :] == best[:, None]
        ids = tl.where(slot == j, best[:, None], ids)
        weights = tl.where(slot == j, tl.sum(tl.where(chosen, scores, 0.0), axis=1)[:, None], weights)
        key = tl.where(chosen, -0x80000000, key)
    if RENORMALIZE:
        weights = weights / tl.where(row_ok, tl.sum(weights, axis=1)[:, None], 1.0)
    out = t[:, None] * top_k + slot
    out_ok = row_ok & (slot < top_k)
    tl.store(weights_ptr + out, weights * routed_scaling, mask=out_ok)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_ok)
    tl.debug_barrier()  # the ids in memory, then their sort reads them
    _sort_small(ids_ptr, pairs_ptr, block_expert_ptr, total_ptr, tokens * top_k, num_experts, rows, num_blocks,
                P, E, R, B, BLOCK_M)  # fmt: skip


@cached_launch
@triton.jit
def _combine_kernel(
    out_ptr, y_ptr, shared_ptr, hidden, top_k, out_stride_t,
    HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``out[t] = round(sum_k y[t * top_k + k] (+ shared[t]))``: a token's weighted expert outputs (float32, rows
    ``hidden`` apart, as the shared experts' ``[tokens, hidden]``) summed in slot order, rounded once."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(top_k):
        acc += tl.load(y_ptr + (token * top_k + k) * hidden + cols, mask=ok, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + token * hidden + cols, mask=ok, other=0.0)
    tl.store(out_ptr + token * out_stride_t + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


#: The most pairs (tokens x top_k) and experts :func:`_sort_small` sorts in one program.
_ALIGN_SMALL_PAIRS, _ALIGN_SMALL_EXPERTS = 128, 256
#: The largest tile of logits (tokens x experts, as powers of two) :func:`_route_small_kernel` holds in one program.
_ROUTE_SMALL_LOGITS = 4096

#: ``(pairs, block_expert, padded_total)``: what :func:`sort_pairs_by_expert` returns.
SortedPairs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _p2(n: int) -> int:
    """A power of two, at least ``n`` and 16 (a comfortable block for every backend)."""
    return max(16, next_power_of_2(n))


def _padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the sorted pairs can take: every expert's run padded to a multiple of ``block_m``."""
    return cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m


def sort_pairs_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """The (token, slot) pairs in expert order, each expert's run padded to a multiple of ``block_m``.

    Returns ``(pairs, block_expert, padded_total)``: ``pairs`` int64 of the most rows the padding can
    take (``num_pairs`` marks padding), ``block_expert`` the expert of each ``block_m`` rows, and a
    one-element tensor of the rows in use. No host read (a count by ``scatter_add_``: ``torch.bincount``
    reads the largest id back to size its output), so a step that calls it can be captured in a device
    graph. Up to 128 pairs (decode) it is one Triton program (:func:`_align_small_kernel`), else torch ops.
    """
    flat = ids.flatten()
    num_pairs = flat.numel()
    rows = _padded_rows(num_pairs, num_experts, block_m)
    if 0 < num_pairs <= _ALIGN_SMALL_PAIRS and num_experts <= _ALIGN_SMALL_EXPERTS:
        flat = flat.contiguous()  # top-1 ids: a strided view
        pairs, block_expert, total = _sort_outputs(rows, block_m, flat.device)
        _align_small_kernel[(1,)](
            flat, pairs, block_expert, total, num_pairs, num_experts, rows, block_expert.numel(),
            **_sort_sizes(num_pairs, num_experts, rows, block_m), num_warps=8,
        )  # fmt: skip
        return pairs, block_expert, total
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    first = counts.cumsum(0) - counts  # each expert's first place in the unpadded order
    dest = (padded_end - padded)[experts] + torch.arange(num_pairs, device=flat.device) - first[experts]
    pairs = torch.full((rows,), num_pairs, dtype=torch.int64, device=flat.device)
    pairs[dest] = order
    starts = torch.arange(0, rows, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert, padded_end[-1:]


def route_and_sort(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str,
    renormalize: bool,
    routed_scaling: float,
    block_m: int,
    one_program: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, SortedPairs]:
    """``route`` then :func:`sort_pairs_by_expert`: ``(weights, ids, sorted pairs)``.

    Where the step is small (a decode step: at most 128 pairs, a tile of at most 4,096 logits, 16- or
    32-bit logits) and ``one_program`` is set, both run in one Triton program (:func:`_route_small_kernel`,
    one launch where ``route``'s torch ops and the sort take about eight); else the torch ops and the sort.
    """
    tokens, num_experts = router_logits.shape
    num_pairs = tokens * top_k
    small = (
        one_program
        and num_pairs <= _ALIGN_SMALL_PAIRS
        and num_experts <= _ALIGN_SMALL_EXPERTS
        and _p2(tokens) * _p2(num_experts) <= _ROUTE_SMALL_LOGITS
        and router_logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if not small:
        weights, ids = route(router_logits, top_k, scoring, renormalize, routed_scaling)
        return weights.float(), ids, sort_pairs_by_expert(ids, num_experts, block_m)
    device = router_logits.device
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    rows = _padded_rows(num_pairs, num_experts, block_m)
    pairs, block_expert, total = _sort_outputs(rows, block_m, device)
    _route_small_kernel[(1,)](
        router_logits, weights, ids, pairs, block_expert, total,
        tokens, num_experts, top_k, router_logits.stride(0), router_logits.stride(1), float(routed_scaling),
        rows, block_expert.numel(), SIGMOID=scoring == "sigmoid", RENORMALIZE=renormalize,
        T=_p2(tokens), K=_p2(top_k), **_sort_sizes(num_pairs, num_experts, rows, block_m), num_warps=8,
    )  # fmt: skip
    return weights, ids, (pairs, block_expert, total)


def _sort_outputs(rows: int, block_m: int, device: torch.device) -> SortedPairs:
    return (
        torch.empty(rows, dtype=torch.int64, device=device),
        torch.empty(rows // block_m, dtype=torch.int64, device=device),
        torch.empty(1, dtype=torch.int64, device=device),
    )


def _sort_sizes(num_pairs: int, num_experts: int, rows: int, block_m: int) -> dict[str, int]:
    """:func:`_sort_small`'s block sizes."""
    return dict(P=_p2(num_pairs), E=_p2(num_experts), R=_p2(rows), B=_p2(rows // block_m), BLOCK_M=block_m)


class MoeKernels:
    """The Triton provider of ``fused_moe``."""

    OPS = ("fused_moe",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def fused_moe(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        top_k: int,
        scoring: str = "softmax",
        renormalize: bool = False,
        activation: str = "silu",
        routed_scaling: float = 1.0,
        shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_fused_moe(x, router_logits, w13, w2, top_k, scoring, renormalize, activation, routed_scaling,
                        shared_w13, shared_w2)  # fmt: skip
        tokens, hidden = x.shape
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        if tokens == 0:
            return out
        tiles = self.target.moe_small if tokens <= self.target.moe_small_tokens else self.target.moe_large
        weights, _, order = route_and_sort(
            router_logits, top_k, scoring, renormalize, routed_scaling, tiles.block_m, self.target.moe_route_small
        )
        y = self.experts(x, weights, order, top_k, w13, w2, activation, tiles)
        shared = None
        if shared_w13 is not None:
            ones = torch.ones(tokens, 1, dtype=torch.float32, device=x.device)
            every = sort_pairs_by_expert(torch.zeros(tokens, 1, dtype=torch.int64, device=x.device), 1, tiles.block_m)
            shared = self.experts(x, ones, every, 1, shared_w13[None], shared_w2[None], activation, tiles)
        block = min(1024, _p2(hidden))
        _combine_kernel[(tokens, cdiv(hidden, block))](
            out, y, y if shared is None else shared, hidden, top_k, out.stride(0),
            HAS_SHARED=shared is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
        return out

    def experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        order: SortedPairs,
        top_k: int,
        w13: torch.Tensor,
        w2: torch.Tensor,
        activation: str,
        tiles: MoeTiles,
    ) -> torch.Tensor:
        """Each pair's weighted expert output, float32 ``[tokens * top_k, hidden]`` (pair ``t * top_k + slot``).

        ``weights``: float32 ``[tokens, top_k]``; ``order``: the pairs sorted by expert (:func:`sort_pairs_by_expert`
        with ``tiles.block_m``).
        """
        hidden = x.shape[1]
        inter = w13.shape[1] // 2
        num_pairs = weights.numel()
        pairs, block_expert, total = order
        dot_fp32 = x.device.type == "cpu" and x.dtype != torch.float32  # the interpreter (see _gate_up_kernel)
        precision = "ieee" if x.dtype == torch.float32 or dot_fp32 else None  # 16-bit inputs: the default
        a = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        blocks = pairs.shape[0] // tiles.block_m
        launch = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                      num_warps=tiles.warps, num_stages=tiles.stages)  # fmt: skip
        _gate_up_kernel[(blocks, cdiv(inter, tiles.block_n))](
            a, x, w13, pairs, block_expert, total, inter, hidden, top_k, num_pairs,
            x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), a.stride(0),
            ACTIVATION=activation, PRECISION=precision, DOT_FP32=dot_fp32, **launch,
        )  # fmt: skip
        y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
        _down_kernel[(blocks, cdiv(hidden, tiles.block_n))](
            y, a, w2, pairs, block_expert, total, weights.flatten().contiguous(), hidden, inter, num_pairs,
            a.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0),
            PRECISION=precision, DOT_FP32=dot_fp32, **launch,
        )  # fmt: skip
        return y
