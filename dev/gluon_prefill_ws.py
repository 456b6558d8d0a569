# ruff: noqa: N803  (Gluon's constexpr parameters and layouts are upper case)
"""EXPERIMENT: ``dev/gluon_prefill.py``'s schedule, warp-specialised as FlashAttention-3 does it.

The first Gluon kernel measured correct but 4-6% slower than the shipped Triton kernel at 4k-16k tokens
(``docs/results/h200/probe-gluon-h200-run1.txt``). Its PTX shows why: every warp issues its own TMA loads, and
the compiler guards each reuse of a shared buffer with a CTA-wide ``bar.sync``, five or six an iteration, so the
two warpgroups run in lockstep and neither softmax can hide under the other's tensor-core work. Here the roles
are split (``gl.warp_specialize``):

- a **producer** warp (24 registers) issues every TMA load: Q once, then key and value tiles into two buffers
  each, waiting on each buffer's ``empty`` barrier before it refills it;
- two **consumer** warpgroups, 64 query rows each, run the first kernel's loop (async ``S_j``, async
  ``P_{j-1} V_{j-1}``, wait 1, softmax under the ``P V`` product, wait 0, rescale) and, instead of any CTA-wide
  barrier, arrive on a buffer's ``empty`` barrier when their product has read it. Each warpgroup runs at its
  own pace, so one's softmax overlaps the other's products.

Buffers: Q ``[2, 64, 128]``, K and V ``[2, 128, 128]`` each (160 KiB); ``full`` barriers count the TMA bytes,
``empty`` barriers count the two consumers. Same scope and contract as the first kernel (``supported``).
"""

from __future__ import annotations

import torch
import triton
from gluon_prefill import HEAD, LOG2E, _cache_row, _online_softmax, supported
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["BLOCK_M", "BLOCK_N", "gluon_prefill_ws"]

BLOCK_M = 128  # query rows a program: two consumer warpgroups of 64
ROWS = 64  # query rows a consumer warpgroup
BLOCK_N = 128  # keys a tile
CONSUMER_REGS = 240
PRODUCER_REGS = 24


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
             table, q_row, q_col, kv_col, n_tiles, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
             ROWS: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """The producer warp: Q's two halves, then key and value tile ``j`` into buffer ``j % 2`` once it is free."""
    tile_bytes: gl.constexpr = BLOCK_N * HEAD * 2
    mbarrier.expect(q_bar, 2 * ROWS * HEAD * 2)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + ROWS, q_col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % 2
        free = ((j // 2) & 1) ^ 1  # a fresh barrier counts as freed once: the first two waits pass at once
        row = _cache_row(table, j, BLOCK_SIZE, BLOCK_N)
        mbarrier.wait(k_empty.index(stage), free)
        mbarrier.expect(k_full.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_full.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), free)
        mbarrier.expect(v_full.index(stage), tile_bytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_full.index(stage), v_smem.index(stage))


@gluon.jit
def _consume(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, v_clean, turns,
             PINGPONG: gl.constexpr, out_ptr, q_start, q_len, m0, first, seq_len, n_tiles, n_full, qk_scale, stride_ot, stride_oh, head,
             BLOCK_N: gl.constexpr, ROWS: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """Consumer warpgroup ``WG``: query rows ``m0 + WG * ROWS`` on, FA3's intra-warpgroup overlap, then the store.

    With ``PINGPONG`` the two warpgroups take turns to issue their products (FA3's inter-warpgroup schedule): round
    ``r`` of warpgroup ``WG`` waits for ``turns[WG]`` and hands the turn over once its products are issued, so the
    tensor cores run one warpgroup's products while the other computes its softmax.
    """
    dtype: gl.constexpr = q_smem.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    cols_of: gl.constexpr = gl.SliceLayout(0, mma)

    q_pos = first + WG * ROWS + gl.arange(0, ROWS, layout=rows_of)
    offs_n = gl.arange(0, BLOCK_N, layout=cols_of)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_of)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=rows_of)
    acc = gl.zeros([ROWS, HEAD], gl.float32, layout=mma)
    q = q_smem.index(WG)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_full.index(0), 0)
    _take_turn(turns, WG, 0, PINGPONG)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, mma),
                          use_acc=False, is_async=True)  # fmt: skip
    _pass_turn(turns, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(0))
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, 0, seq_len, n_full, BLOCK_N)
    p_prev = gl.convert_layout(p.to(dtype), p_operand)
    for j in range(1, n_tiles):
        stage = j % 2
        prev = 1 - stage
        mbarrier.wait(k_full.index(stage), (j // 2) & 1)
        mbarrier.wait(v_full.index(prev), ((j - 1) // 2) & 1)
        _take_turn(turns, WG, j, PINGPONG)
        s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, mma),
                              use_acc=False, is_async=True)  # fmt: skip
        acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # the scores are in; P V still runs
        mbarrier.arrive(k_empty.index(stage))
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, j, seq_len, n_full, BLOCK_N)
        acc, p_prev = warpgroup_mma_wait(0, deps=[acc_tok, p_prev])
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(alpha, 1)
        p_prev = gl.convert_layout(p.to(dtype), p_operand)

    last = (n_tiles - 1) % 2
    mbarrier.wait(v_full.index(last), ((n_tiles - 1) // 2) & 1)
    if n_tiles * BLOCK_N > seq_len:  # value rows past the end may hold NaN: warpgroup 0 zeroes them for both
        if WG == 0:
            _zero_rows_past(v_smem.index(last), n_tiles - 1, seq_len, BLOCK_N, HEAD)
            mbarrier.arrive(v_clean)
        else:
            mbarrier.wait(v_clean, 0)
    _take_turn(turns, WG, n_tiles, PINGPONG)
    acc_tok = warpgroup_mma(p_prev, v_smem.index(last), acc, is_async=True)
    _pass_turn(turns, WG, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=[acc_tok])

    out = acc / gl.expand_dims(gl.where(l_i > 0, l_i, 1.0), 1)
    rows = m0 + WG * ROWS + gl.arange(0, ROWS, layout=rows_of)
    cols = gl.arange(0, HEAD, layout=cols_of)
    ptrs = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
    gl.store(ptrs + gl.expand_dims(cols, 0), out.to(dtype), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _take_turn(turns, WG: gl.constexpr, round, PINGPONG: gl.constexpr):
    """Wait for this warpgroup's turn to issue products (round ``round``); warpgroup 0 goes first."""
    if PINGPONG:
        mbarrier.wait(turns.index(WG), (round & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - WG))


@gluon.jit
def _zero_rows_past(v_tile, tile, seq_len, BLOCK_N: gl.constexpr, HEAD: gl.constexpr):
    """Zero the value rows of the last tile past the sequence's end (one warpgroup's stores, then its fence)."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_tile.load(blocked)
    k_pos = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
    v_tile.store(gl.where(gl.expand_dims(k_pos < seq_len, 1), v, gl.zeros_like(v)))
    fence_async_shared()  # the tensor cores read shared memory through the async proxy
    gl.thread_barrier()


@gluon.jit
def _ws_prefill_kernel(q_desc, k_desc, v_desc, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, qk_scale,
                       stride_ot, stride_oh, stride_bt, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, ROWS: gl.constexpr, HEAD: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    head = gl.program_id(0)
    seq = gl.program_id(1)
    q_block = gl.num_programs(2) - 1 - gl.program_id(2)  # every head's heaviest query block first
    q_start = gl.load(cu_seqlens_q_ptr + seq)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    m0 = q_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len
        first = ctx + m0
        last = ctx + gl.minimum(m0 + BLOCK_M, q_len) - 1
        n_tiles = (last + BLOCK_N) // BLOCK_N  # key tiles some row sees
        n_full = (first + 1) // BLOCK_N  # ... and those every row sees whole
        if n_tiles > 0:
            table = block_tables_ptr + seq.to(gl.int64) * stride_bt
            q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            v_clean = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            v_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            mbarrier.init(v_clean, count=1)
            for i in gl.static_range(2):
                mbarrier.init(k_full.index(i), count=1)
                mbarrier.init(v_full.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=2)  # one arrival from each consumer warpgroup
                mbarrier.init(v_empty.index(i), count=2)
                mbarrier.init(turns.index(i), count=1)
            fence_async_shared()
            # fmt: off
            gl.warp_specialize([
                (_consume, (0, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, v_clean, turns,
                            PINGPONG, out_ptr, q_start, q_len, m0, first, seq_len, n_tiles, n_full, qk_scale,
                            stride_ot, stride_oh, head, BLOCK_N, ROWS, HEAD)),
                (_consume, (1, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, v_clean, turns,
                            PINGPONG, out_ptr, q_start, q_len, m0, first, seq_len, n_tiles, n_full, qk_scale,
                            stride_ot, stride_oh, head, BLOCK_N, ROWS, HEAD)),
                (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
                            table, q_start + m0, head * HEAD, (head // GROUP) * HEAD, n_tiles, BLOCK_SIZE, BLOCK_N,
                            ROWS, HEAD)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
            # fmt: on
        else:  # a padded sequence (no cached token): the contract wants zeros
            _store_zeros(out_ptr, q_start, q_len, m0, head, stride_ot, stride_oh, BLOCK_M, HEAD)


@gluon.jit
def _store_zeros(out_ptr, q_start, q_len, m0, head, stride_ot, stride_oh, BLOCK_M: gl.constexpr, HEAD: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, blocked))
    ptrs = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
    zeros = gl.zeros([BLOCK_M, HEAD], out_ptr.dtype.element_ty, layout=blocked)
    gl.store(ptrs + gl.expand_dims(cols, 0), zeros, mask=gl.expand_dims(rows < q_len, 1))


def gluon_prefill_ws(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
                     sliding_window=0, soft_cap=0.0, *, pingpong: bool = True) -> torch.Tensor:  # fmt: skip
    """``prefill_attention`` (the op's signature) by the experiment; raises ``ValueError`` outside its scope.
    ``pingpong``: the two consumer warpgroups take turns at the tensor cores (FA3's inter-warpgroup schedule)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    why = supported(query, key_cache, value_cache, sliding_window, soft_cap)
    if why:
        raise ValueError(f"gluon_prefill_ws: {why}; use the shipped kernel")
    num_tokens, num_heads, head = query.shape
    blocks, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    dtype = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q_desc = TensorDescriptor.from_tensor(query.view(num_tokens, num_heads * head), [ROWS, HEAD], q_layout)
    k_desc = TensorDescriptor.from_tensor(key_cache.view(blocks * block_size, kv_heads * head), [BLOCK_N, HEAD],
                                          kv_layout)  # fmt: skip
    v_desc = TensorDescriptor.from_tensor(value_cache.view(blocks * block_size, kv_heads * head), [BLOCK_N, HEAD],
                                          kv_layout)  # fmt: skip
    grid = (num_heads, seq_lens.shape[0], triton.cdiv(max_query_len, BLOCK_M))
    _ws_prefill_kernel[grid](
        q_desc, k_desc, v_desc, out, block_tables, cu_seqlens_q, seq_lens, float(scale) * LOG2E,
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, ROWS=ROWS, HEAD=HEAD,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, PINGPONG=pingpong, num_warps=4,
    )  # fmt: skip
    return out
