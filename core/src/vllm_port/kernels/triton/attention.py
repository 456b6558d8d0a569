"""Paged attention in Triton: decode (one query token per sequence) and varlen causal prefill.

Both kernels read K/V straight from the paged cache ``[num_blocks, block_size, num_kv_heads,
head_size]``: key ``t`` of sequence ``s`` is row ``t % block_size`` of physical block
``block_tables[s, t // block_size]``. Scores are computed with ``tl.dot`` (float32 accumulation)
and normalised with an online softmax in float32, in base 2 (``exp2``), the scale folded into one
multiply.

Decode (:meth:`AttentionKernels.paged_attention`)
    One program per ``(sequence, KV head[, split])``. It holds *all* the query heads that share
    the KV head (GQA) as the rows of one ``[GROUP_PAD, head]`` tile (padded to a power of two
    >= 16 for ``tl.dot``), so every K/V row is loaded once and used by the whole group. Decode is
    memory bound: the work is streaming K/V; the padded rows cost tensor-core time nobody waits for.
    When ``num_seqs * num_kv_heads`` programs are too few to fill the GPU, the key range is also
    split ``num_splits`` ways (flash-decoding): each split writes an unnormalised partial
    (``acc, m, l``) and a second kernel merges them. The number of splits is chosen on the host from
    shapes only; each program then divides *its own* sequence's key tiles among the splits, so long
    and short sequences alike use every split.

Prefill (:meth:`AttentionKernels.prefill_attention`)
    Flash attention over a packed batch: one program per ``(query head, sequence, query block)``,
    the heaviest (last) query blocks launched first so that the lightest fill the tail; the target's
    ``prefill_order`` says whether one head's blocks go before the next head's, or every head's
    heaviest block before any lighter one. A program skips the key tiles that causality or the
    sliding window hide entirely, runs the tiles every query row sees in full without any mask, and
    applies the causal/window mask only on the few tiles at the diagonal (and at the window's edge).

Cache slots a sequence does not own may hold anything (the tests fill them with NaN): every load
that can reach such a slot is masked with ``other=0``, so nothing from them enters a sum.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ...device_properties import compute_units
from ...ops.attention import check_paged_attention, check_prefill_attention
from ..triton_target import PREFILL_ORDERS, TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["AttentionKernels"]

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax runs in base 2: exp(x) = exp2(x * LOG2E)

# Split-K (flash-decoding) policy for decode, all from host-known shapes.
# The target's ``decode_programs_per_sm`` says how many programs per SM to aim at (a batch already
# giving half as many is not split) and ``decode_min_tiles_per_split`` how short a split may get.
_MAX_SPLITS = 256
# The merge sums up to this many splits' partial outputs per step: 128 x 128 float32 over 8 warps for head 128
# (64 registers a thread; twice that for head 256). Up to 128 splits it is one load, not a chain of dependent steps;
# more (the split rule allows 256: long block tables, few KV heads) take several.
_MERGE_CHUNK = 128


# ------------------------------------------------------------------------------------------------
# Helpers shared by both kernels
# ------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh from exp2 (not every Triton version has a portable tanh); exact limits at +-inf.

    (1 - e) / (1 + e) with e = exp(-2|x|) cancels for small |x| (a soft cap of 1e6 put scores 0.03
    off): below 1/4 it is tanh's odd series to x^9, whose next term is under 1e-8 of the value.
    """
    a = tl.abs(x)
    e = tl.exp2((-2.0 * LOG2E) * a)  # exp(-2|x|) in (0, 1]: never overflows
    a2 = a * a
    near = a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315 + a2 * (62.0 / 2835)))))
    t = tl.where(a < 0.25, near, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def _page_rows(
    block_table_row,
    start,
    offs_n,
    limit,
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Where keys ``start .. start+BLOCK_N-1`` of a sequence live: ``(physical block, row in it)``.

    Args:
        block_table_row: pointer to the sequence's row of ``block_tables``.
        start: the tile's first key position (a multiple of the tile size).
        offs_n: ``arange(0, BLOCK_N)``.
        limit: keys at or past it are not read (their block-table entry may not exist).
        PAGE_TILE: the whole tile lies in one cache block (``block_size % BLOCK_N == 0``):
            one scalar block-table load instead of one per key.
        MASKED: ``limit`` can fall inside this tile.

    The physical block comes back as int64: ``block * stride`` overflows int32 on large caches.
    """
    if PAGE_TILE:
        block = tl.load(block_table_row + start // BLOCK_SIZE).to(tl.int64)
        return block, (start % BLOCK_SIZE) + offs_n
    else:
        pos = start + offs_n
        if MASKED:
            block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos < limit, other=0)
        else:
            block = tl.load(block_table_row + pos // BLOCK_SIZE)
        return block.to(tl.int64), pos % BLOCK_SIZE


@triton.jit
def _attend_tile(
    acc,  # [rows, HEAD_PAD] float32 running (unnormalised) output of the query rows
    l_i,  # [rows] running softmax denominators
    m_i,  # [rows] running maxima of the base-2 scores
    q,  # [rows, HEAD_PAD] queries
    q_pos,  # [rows] positions of the query rows in the sequence
    start,  # first key position of the tile
    offs_n,  # arange(0, BLOCK_N)
    offs_d,  # arange(0, HEAD_PAD)
    d_ok,  # offs_d < HEAD_SIZE
    seq_len,
    lo,  # lowest key position any query row sees: keys below it are not even loaded
    sliding_window,
    qk_scale,  # scores are qk * qk_scale, or with a soft cap tanh(qk * qk_scale) * s_scale
    s_scale,
    table,  # the sequence's block-table row
    k_cache_ptr,
    v_cache_ptr,
    k_head,  # offset of the KV head in a cache row (int64)
    v_head,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    k_desc,  # TMA descriptors of the caches as [num_blocks, block_size, num_kv_heads * HEAD] (TMA only)
    v_desc,
    kv_col,  # the KV head's first column in a descriptor row (TMA only)
    BLOCK_SIZE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,  # the tile crosses the diagonal, the window edge or the sequence end
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TMA: tl.constexpr,  # load K/V tiles with the tensor memory accelerator (needs PAGE_TILE)
):
    """One step of the online softmax over keys ``start .. start+BLOCK_N-1``: decode (the query
    heads of one KV head, all at the last position) and prefill (a block of query rows) share it."""
    k_pos = start + offs_n
    key_ok = (k_pos < seq_len) & (k_pos >= lo)
    if TMA:  # the whole tile is rows of one cache block: one bulk copy each for K and V
        tile_block = tl.load(table + start // BLOCK_SIZE)
        k = tl.reshape(k_desc.load([tile_block, start % BLOCK_SIZE, kv_col]), [offs_n.shape[0], offs_d.shape[0]])
        v = tl.reshape(v_desc.load([tile_block, start % BLOCK_SIZE, kv_col]), [offs_n.shape[0], offs_d.shape[0]])
        if MASKED:  # rows past the sequence may hold NaN: 0 * NaN would poison the P @ V sum
            v = tl.where(key_ok[:, None], v, 0.0)
    else:
        if MASKED:
            kv_mask = key_ok[:, None] & d_ok[None, :]  # other=0: slots past the sequence may hold NaN
        else:
            kv_mask = d_ok[None, :]
        block, row = _page_rows(table, start, offs_n, seq_len, BLOCK_SIZE, PAGE_TILE, MASKED)
        k_ptrs = k_cache_ptr + (block * stride_kb + row * stride_ks + k_head)[:, None] + offs_d[None, :]
        v_ptrs = v_cache_ptr + (block * stride_vb + row * stride_vs + v_head)[:, None] + offs_d[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if USE_SOFT_CAP or MASKED:
        s = qk * qk_scale
        if USE_SOFT_CAP:
            s = _tanh(s) * s_scale
        if MASKED:
            seen = (k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            if USE_WINDOW:
                seen = seen & (k_pos[None, :] > q_pos[:, None] - sliding_window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.exp2(s - m_use[:, None])
    else:
        # the hot path (every key seen, no cap): scale folded into the exponent, one FMA per score
        # (qk_scale > 0, so the row max of the scaled scores is the scaled row max)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = m_new
        p = tl.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if not TMA:  # loaded after the scores: fewer registers held across the softmax
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if v.dtype.is_fp8():  # an FP8 cache: values widened to the query's dtype (exact), probabilities kept in it
        v = v.to(q.dtype)
    p = p.to(v.dtype)  # probabilities rounded to the cache's dtype for the tensor cores
    if DOT_FP32:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# ------------------------------------------------------------------------------------------------
# Decode
# ------------------------------------------------------------------------------------------------


@cached_launch
@triton.jit
def _paged_decode_kernel(
    out_ptr,  # [num_seqs, num_heads, HEAD_SIZE] in the query's dtype (written unless SPLIT)
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_SIZE] float32 unnormalised partial outputs
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32 running max (base 2) of each split
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32 softmax denominators of each split
    q_ptr,  # [num_seqs, num_heads, HEAD_SIZE] query (the sequence's last token)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
    v_cache_ptr,  # same layout as the key cache
    block_tables_ptr,  # [num_seqs, max_blocks] int32/int64 physical block of each logical block
    seq_lens_ptr,  # [num_seqs] tokens in the cache, the query's own included
    scale,  # softmax scale (usually head_size ** -0.5)
    soft_cap,  # > 0: scores become soft_cap * tanh(score / soft_cap)
    sliding_window,  # > 0: only the sliding_window most recent keys are seen
    out_scale,  # the output's factor: an FP8 cache's v_scale (1.0 otherwise)
    stride_qs,  # query strides: sequence, head (the head dim is contiguous, as in every tensor here)
    stride_qh,
    stride_os,  # output strides: sequence, head
    stride_oh,
    stride_kb,  # key cache strides: block, row in the block, KV head
    stride_ks,
    stride_kh,
    stride_vb,  # value cache strides: block, row in the block, KV head
    stride_vs,
    stride_vh,
    stride_bt,  # block_tables row stride
    num_splits,  # programs sharing one sequence's keys (a runtime value: batch sizes do not recompile)
    k_desc,  # TMA descriptors of the caches (TMA only; see _kv_descriptors)
    v_desc,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two >= 16 (tl.dot's minimum M)
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # HEAD_SIZE rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens per physical block)
    BLOCK_N: tl.constexpr,  # keys per loop step
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for _merge_splits_kernel, else the output
    PAGE_TILE: tl.constexpr,  # BLOCK_SIZE % BLOCK_N == 0: a key tile never straddles two blocks
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), None for 16-bit inputs
    DOT_FP32: tl.constexpr,  # feed tl.dot float32 operands (CPU interpreter only, see _dot_fp32)
    TMA: tl.constexpr,  # K/V tiles through the tensor memory accelerator (every tile inside one cache block)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0  # first key position the query sees
    if USE_WINDOW:
        lo = tl.maximum(seq_len - sliding_window, 0)
    tile_lo = lo // BLOCK_N
    tile_hi = tl.cdiv(seq_len, BLOCK_N)
    if SPLIT:  # this split's share of this sequence's tiles
        per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, tile_hi)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_SIZE  # all true unless the head is padded; constant along it, so loads stay vectorised
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q_ptrs = q_ptr + (seq.to(tl.int64) * stride_qs + heads * stride_qh)[:, None] + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    s_scale = 1.0
    if USE_SOFT_CAP:  # s = soft_cap * tanh(scale * qk / soft_cap), in base 2
        qk_scale = scale / soft_cap
        s_scale = soft_cap * LOG2E
    else:
        qk_scale = scale * LOG2E

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    q_pos = tl.zeros([GROUP_PAD], tl.int32) + (seq_len - 1)  # every query head sits at the last position
    for tile in range(tile_lo, tile_hi):  # the prefill step, every tile masked (a one-row causal diagonal)
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, tile * BLOCK_N, offs_n, offs_d, d_ok, seq_len, lo, sliding_window, qk_scale,
            s_scale, table, k_cache_ptr, v_cache_ptr, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
            k_desc, v_desc, kv_head * HEAD_SIZE, BLOCK_SIZE, PAGE_TILE, USE_SOFT_CAP, USE_WINDOW, True, DOT_PRECISION,
            DOT_FP32, TMA,
        )  # fmt: skip

    if not SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale  # l == 0 only for an empty sequence: output 0
        o_ptrs = out_ptr + (seq.to(tl.int64) * stride_os + heads * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        # partials are contiguous: index ((seq * num_heads + head) * num_splits + split)
        part = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=head_ok)
        tl.store(part_l_ptr + part, l_i, mask=head_ok)
        a_ptrs = part_acc_ptr + (part * HEAD_SIZE)[:, None] + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=head_ok[:, None] & d_ok[None, :])


@cached_launch
@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, HEAD_SIZE]
    part_acc_ptr,  # [num_seqs, num_heads, num_splits, HEAD_SIZE] float32
    part_m_ptr,  # [num_seqs, num_heads, num_splits] float32 (base-2 max; -inf for an empty split)
    part_l_ptr,  # [num_seqs, num_heads, num_splits] float32
    stride_os,  # output strides: sequence, head
    stride_oh,
    num_splits,
    out_scale,  # the output's factor: an FP8 cache's v_scale (1.0 otherwise)
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
    CHUNK: tl.constexpr,  # splits whose partial outputs are summed per step (bounds the registers held)
):
    """One program per (sequence, query head): rescale each split's partial to a common max and normalise."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_SIZE
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits

    m_part = tl.load(part_m_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m_max = tl.max(m_part, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (empty sequence)
    denom = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([CHUNK, HEAD_PAD], tl.float32)
    for first in range(0, num_splits, CHUNK):
        offs_c = first + tl.arange(0, CHUNK)
        c_ok = offs_c < num_splits
        w = tl.exp2(tl.load(part_m_ptr + base + offs_c, mask=c_ok, other=float("-inf")) - m_max)  # empty: 0
        denom += tl.load(part_l_ptr + base + offs_c, mask=c_ok, other=0.0) * w
        a_ptrs = part_acc_ptr + ((base + offs_c) * HEAD_SIZE)[:, None] + offs_d[None, :]
        acc += tl.load(a_ptrs, mask=c_ok[:, None] & d_ok[None, :], other=0.0) * w[:, None]
    total = tl.sum(denom, 0)
    out = tl.sum(acc, 0) / tl.where(total > 0, total, 1.0) * out_scale
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ------------------------------------------------------------------------------------------------
# Prefill
# ------------------------------------------------------------------------------------------------


@cached_launch
@triton.jit
def _prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, HEAD_SIZE]
    q_ptr,  # [num_tokens, num_heads, HEAD_SIZE] packed queries of all sequences
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_SIZE]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    cu_seqlens_q_ptr,  # [num_seqs + 1] offsets of each sequence's queries in the packed batch
    seq_lens_ptr,  # [num_seqs] cached tokens (prefix + the new ones)
    scale,  # softmax scale
    soft_cap,  # > 0: scores become soft_cap * tanh(score / soft_cap)
    sliding_window,  # > 0: query at position p sees keys p - sliding_window + 1 .. p
    out_scale,  # the output's factor: an FP8 cache's v_scale (1.0 otherwise)
    stride_qt,  # query strides: token, head
    stride_qh,
    stride_ot,  # output strides: token, head
    stride_oh,
    stride_kb,  # key cache strides: block, row in the block, KV head
    stride_ks,
    stride_kh,
    stride_vb,  # value cache strides
    stride_vs,
    stride_vh,
    stride_bt,  # block_tables row stride
    k_desc,  # TMA descriptors of the caches (TMA only; see _kv_descriptors)
    v_desc,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop step
    PAGE_TILE: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    TMA: tl.constexpr,  # K/V tiles through the tensor memory accelerator (every tile inside one cache block)
    ORDER: tl.constexpr,  # launch order: index in PREFILL_ORDERS, matching the grid of _prefill_grid
):
    # Causal blocks late in a sequence do the most work: launch them first so the short ones fill the tail.
    seq = tl.program_id(1)
    if ORDER == 0:  # "head": one query head's blocks heaviest to lightest, then the next head's
        q_block = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(2)
    else:  # "all_heads": every head's heaviest block, then every head's next
        head = tl.program_id(0)
        q_block = tl.num_programs(2) - 1 - tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = q_block * BLOCK_M
    if m0 < q_len:  # grids are sized by max_query_len: shorter sequences have idle blocks
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # tokens cached before this step's queries
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_PAD)
        d_ok = offs_d < HEAD_SIZE
        row_ok = offs_m < q_len
        q_pos = ctx + offs_m
        first = ctx + m0  # position of the block's first query
        last = ctx + tl.minimum(m0 + BLOCK_M, q_len) - 1  # ... and of its last real one

        q_ptrs = q_ptr + ((q_start + offs_m).to(tl.int64) * stride_qt + head * stride_qh)[:, None] + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        s_scale = 1.0
        if USE_SOFT_CAP:  # s = soft_cap * tanh(scale * qk / soft_cap), in base 2
            qk_scale = scale / soft_cap
            s_scale = soft_cap * LOG2E
        else:
            qk_scale = scale * LOG2E

        # Key tiles: [t_begin, t_end) holds every key some row sees. Inside it, [u_begin, u_end) are
        # the tiles every row sees whole (past the window edge of the last row, up to the first
        # row's diagonal): no mask there. The tiles either side get the mask.
        lo = 0
        full_lo = 0
        if USE_WINDOW:
            lo = tl.maximum(first - sliding_window + 1, 0)
            full_lo = tl.maximum(last - sliding_window + 1, 0)
        t_begin = lo // BLOCK_N
        t_end = tl.cdiv(last + 1, BLOCK_N)
        u_begin = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_begin), t_end)
        u_end = tl.minimum(tl.maximum((first + 1) // BLOCK_N, u_begin), t_end)

        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        k_head = kv_head.to(tl.int64) * stride_kh
        v_head = kv_head.to(tl.int64) * stride_vh
        kv_col = kv_head * HEAD_SIZE
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
        for tile in range(t_begin, u_begin):  # before the window edge (sliding window only)
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, tile * BLOCK_N, offs_n, offs_d, d_ok, seq_len, lo, sliding_window, qk_scale,
                s_scale, table, k_cache_ptr, v_cache_ptr, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                k_desc, v_desc, kv_col, BLOCK_SIZE, PAGE_TILE, USE_SOFT_CAP, USE_WINDOW, True, DOT_PRECISION, DOT_FP32,
                TMA,
            )  # fmt: skip
        for tile in range(u_begin, u_end):  # seen by every row: no mask
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, tile * BLOCK_N, offs_n, offs_d, d_ok, seq_len, lo, sliding_window, qk_scale,
                s_scale, table, k_cache_ptr, v_cache_ptr, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                k_desc, v_desc, kv_col, BLOCK_SIZE, PAGE_TILE, USE_SOFT_CAP, USE_WINDOW, False, DOT_PRECISION, DOT_FP32,
                TMA,
            )  # fmt: skip
        for tile in range(u_end, t_end):  # the diagonal
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, tile * BLOCK_N, offs_n, offs_d, d_ok, seq_len, lo, sliding_window, qk_scale,
                s_scale, table, k_cache_ptr, v_cache_ptr, k_head, v_head, stride_kb, stride_ks, stride_vb, stride_vs,
                k_desc, v_desc, kv_col, BLOCK_SIZE, PAGE_TILE, USE_SOFT_CAP, USE_WINDOW, True, DOT_PRECISION, DOT_FP32,
                TMA,
            )  # fmt: skip

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * out_scale
        o_ptrs = out_ptr + ((q_start + offs_m).to(tl.int64) * stride_ot + head * stride_oh)[:, None] + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units, Xe cores) of ``device``, as the platform says: no sync."""
    return compute_units(device, default=4)  # the interpreter: a few "SMs" so tiny test batches exercise the split path


def _decode_splits(num_programs: int, max_tiles: int, num_sms: int, per_sm: int = 4, min_tiles: int = 4) -> int:
    """How many ways to split each sequence's keys, from shapes known on the host.

    No split while ``num_seqs * num_kv_heads`` programs already give every SM half of ``per_sm``;
    otherwise aim at ``per_sm`` programs per SM, each split keeping at least ``min_tiles`` key
    tiles of the longest sequence the block table can describe (fewer make the merge the cost).
    """
    if num_programs <= 0 or 2 * num_programs >= per_sm * num_sms:
        return 1
    wanted = cdiv(per_sm * num_sms, num_programs)
    return max(1, min(wanted, cdiv(max_tiles, min_tiles), _MAX_SPLITS))


def _prefill_grid(order: int, q_blocks: int, num_seqs: int, num_heads: int) -> tuple[int, int, int]:
    """The prefill grid of launch order ``order`` (launched x fastest; y and z extents are at most 65535)."""
    return (q_blocks, num_seqs, num_heads) if order == 0 else (num_heads, num_seqs, q_blocks)


def _tiles(target: TritonTarget, head_pad: int, elem_size: int, decode: bool = False) -> tuple[int, int, int]:
    """``(block_m, block_n, stages)``: the target's (prefill's or ``decode``'s), shrunk for rows wider than
    bf16 x 128 (head 256, float32).

    K/V tiles are ``block_n * head_pad * elem_size`` bytes, buffered up to ``stages`` deep in shared
    memory, and the accumulator is ``block_m * head_pad`` float32 registers: both are halved per doubling
    of the row past 256 bytes (CUDA: 128/64 for bf16 x 128, 64/32 for float32 x 128 or bf16 x 256).
    """
    block_m, block_n, stages = target.attn_block_m, target.attn_block_n, target.attn_stages
    if decode:
        block_n, stages = target.decode_block_n or block_n, target.decode_stages or stages
    row_bytes = head_pad * elem_size
    for _ in range(max(0, (row_bytes // 256).bit_length() - 1)):  # halve per doubling of the row
        block_m, block_n, stages = max(16, block_m // 2), max(16, block_n // 2), max(1, min(stages, 2))
    return block_m, block_n, stages


def _kv_descriptors(key_cache: torch.Tensor, value_cache: torch.Tensor, block_n: int) -> tuple[Any, Any] | None:
    """TMA descriptors of both caches as ``[num_blocks, block_size, num_kv_heads * head]`` with ``[1, block_n, head]``
    boxes, or None where the layout does not allow them (then the kernel gathers rows with pointer loads).

    A box must lie inside one cache block (``block_size % block_n == 0``), a KV head's features must be contiguous
    and follow each other in a row, the head a power of two of at least 16 bytes, and every stride and the base
    16-byte aligned.
    """
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side descriptors
        return None
    descriptors = []
    for cache in (key_cache, value_cache):
        num_blocks, block_size, num_kv_heads, head = cache.shape
        sb, ss, sh, sd = cache.stride()
        size = cache.element_size()
        if (
            block_size % block_n
            or (head * size) % 16  # a box row is at least 16 bytes
            or sd != 1
            or sh != head
            or head & (head - 1)
            or (sb * size) % 16
            or (ss * size) % 16
            or cache.data_ptr() % 16
        ):
            return None
        descriptors.append(
            TensorDescriptor(cache, [num_blocks, block_size, num_kv_heads * head], [sb, ss, 1], [1, block_n, head])
        )
    return descriptors[0], descriptors[1]


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels step along the last dimension by 1 (head features, block-table columns, 1-D metadata); copy the
    rare tensor that does not (a metadata check, no sync; a no-op for what engines pass)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # float32 must not round to TF32 (tolerance 1e-4)


def _dot_fp32(query: torch.Tensor) -> bool:
    """Upcast tl.dot's 16-bit operands on the CPU interpreter (exact: products are summed in float32 anyway).

    Its dot multiplies bfloat16 bit patterns as integers, and NumPy has no fast float16 matmul.
    """
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


class AttentionKernels:
    """Decode and prefill attention over the paged KV cache, launched with one target's tiles."""

    OPS = ("paged_attention", "prefill_attention")

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def paged_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """Decode attention (see :func:`vllm_port.ops.attention.paged_attention_reference`)."""
        check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
        return self._decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)

    def _decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, num_splits=None,
        out_scale=1.0,
    ):  # fmt: skip
        """Launch decode with ``num_splits`` key splits (None: by :func:`_decode_splits`; 1: no merge kernel).

        ``out_scale`` multiplies the output (an FP8 cache's ``v_scale``; its ``k_scale`` comes folded into ``scale``).
        """
        query, key_cache, value_cache = _unit_stride(query), _unit_stride(key_cache), _unit_stride(value_cache)
        block_tables, seq_lens = _unit_stride(block_tables), _unit_stride(seq_lens)  # read at +1 per entry
        num_seqs, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_seqs == 0:
            return out
        group = num_heads // num_kv_heads
        head_pad = next_power_of_2(head_size)
        _, block_n, stages = _tiles(self.target, head_pad, key_cache.element_size(), decode=True)
        if num_splits is None:
            max_tiles = cdiv(block_tables.shape[1] * block_size, block_n)  # of the longest sequence possible
            if sliding_window > 0:  # a query sees at most the window (plus the tile it starts in)
                max_tiles = min(max_tiles, cdiv(sliding_window, block_n) + 1)
            num_splits = _decode_splits(
                num_seqs * num_kv_heads,
                max_tiles,
                _num_sms(query.device),
                self.target.decode_programs_per_sm,
                self.target.decode_min_tiles_per_split,
            )
        tma = self.target.decode_tma and key_cache.element_size() > 1  # FP8 caches gather rows (TMA unmeasured)
        descriptors = _kv_descriptors(key_cache, value_cache, block_n) if tma else None
        if num_splits > 1:
            part_acc = torch.empty(num_seqs, num_heads, num_splits, head_size, device=query.device, dtype=torch.float32)
            part_m = torch.empty(num_seqs, num_heads, num_splits, device=query.device, dtype=torch.float32)
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # unused
        _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            out, part_acc, part_m, part_l,
            query, key_cache, value_cache, block_tables, seq_lens,
            float(scale), float(soft_cap), int(sliding_window), float(out_scale),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0), num_splits, *(descriptors or (None, None)),
            GROUP=group,
            GROUP_PAD=max(16, next_power_of_2(group)),
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            SPLIT=num_splits > 1,
            PAGE_TILE=block_size % block_n == 0,
            USE_SOFT_CAP=soft_cap > 0,
            USE_WINDOW=sliding_window > 0,
            DOT_PRECISION=_dot_precision(query.dtype),
            DOT_FP32=_dot_fp32(query),
            TMA=descriptors is not None,
            num_warps=self.target.decode_warps,
            num_stages=stages,
        )  # fmt: skip
        if num_splits > 1:
            splits_pad = next_power_of_2(num_splits)
            _merge_splits_kernel[(num_seqs, num_heads)](
                out, part_acc, part_m, part_l, out.stride(0), out.stride(1), num_splits, float(out_scale),
                HEAD_SIZE=head_size,
                HEAD_PAD=head_pad,
                SPLITS_PAD=splits_pad,
                CHUNK=min(splits_pad, _MERGE_CHUNK),
                num_warps=4 if splits_pad <= 32 else 8,
            )  # fmt: skip
        return out

    def prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """Causal varlen attention over the paged cache (see :func:`vllm_port.ops.attention.prefill_attention_reference`)."""
        args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale)
        check_prefill_attention(*args, sliding_window, soft_cap)
        return self._prefill(*args, sliding_window, soft_cap)

    def _prefill(
        self, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
        sliding_window, soft_cap, out_scale=1.0,
    ):  # fmt: skip
        """Launch prefill on checked arguments; ``out_scale`` multiplies the output (as :meth:`_decode`'s)."""
        query, key_cache, value_cache = _unit_stride(query), _unit_stride(key_cache), _unit_stride(value_cache)
        # the kernel reads these at +1 per entry: a strided view (found by fuzzing) read other memory
        block_tables, cu_seqlens_q, seq_lens = (
            _unit_stride(block_tables),
            _unit_stride(cu_seqlens_q),
            _unit_stride(seq_lens),
        )
        num_tokens, num_heads, head_size = query.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        num_seqs = seq_lens.shape[0]
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if num_tokens == 0 or num_seqs == 0:
            return out
        head_pad = next_power_of_2(head_size)
        block_m, block_n, stages = _tiles(self.target, head_pad, query.element_size())
        q_blocks = cdiv(max_query_len, block_m)
        order = PREFILL_ORDERS.index(self.target.prefill_order)
        if q_blocks > 65535:  # past the grid's z extent (millions of tokens): one head at a time
            order = 0
        grid = _prefill_grid(order, q_blocks, num_seqs, num_heads)
        tma = self.target.prefill_tma and key_cache.element_size() > 1  # FP8 caches gather rows (TMA unmeasured)
        descriptors = _kv_descriptors(key_cache, value_cache, block_n) if tma else None
        _prefill_kernel[grid](
            out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
            float(scale), float(soft_cap), int(sliding_window), float(out_scale),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0),
            *(descriptors or (None, None)),
            GROUP=num_heads // num_kv_heads,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            BLOCK_SIZE=block_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            PAGE_TILE=block_size % block_n == 0,
            USE_SOFT_CAP=soft_cap > 0,
            USE_WINDOW=sliding_window > 0,
            DOT_PRECISION=_dot_precision(query.dtype),
            DOT_FP32=_dot_fp32(query),
            TMA=descriptors is not None,
            ORDER=order,
            num_warps=self.target.attn_warps,
            num_stages=stages,
        )  # fmt: skip
        return out
