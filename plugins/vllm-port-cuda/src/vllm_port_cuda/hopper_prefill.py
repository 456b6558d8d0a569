# ruff: noqa: N803, N806  (Gluon's constexpr parameters and layouts are upper case)
"""Prefill attention for Hopper (sm_90): FlashAttention-3's schedule, written in Gluon, over the paged cache.

Triton 3.6 waits for every ``wgmma`` before the softmax reads its scores, so the shared Triton kernel overlaps
exponentials with tensor-core work only across two programs on an SM and stops at 0.81-0.85x cuDNN at 8k-16k
tokens (``docs/results/attention-h200.md``). Gluon, Triton's explicit-layout dialect, exposes the asynchronous
``wgmma``, its waits, TMA and ``mbarrier``, so this kernel writes FA3's schedule out. Each program owns 128 query
rows of one head, and its warps split into roles (``gl.warp_specialize``):

- a **producer** warp (24 registers) issues every TMA load: Q once, then key and value tiles of 128 tokens into
  two buffers each, waiting on a buffer's ``empty`` barrier before refilling it;
- two **consumer** warpgroups (240 registers each), 64 query rows each. Per key tile ``j`` a consumer issues
  ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` asynchronously, waits for the scores only, runs the online
  softmax of ``S_j`` (exp2, the scale folded in) while the tensor cores still compute ``P V``, then waits for
  ``P V`` and rescales ``O`` (FA3's intra-warpgroup overlap). It arrives on a buffer's ``empty`` barrier once
  its product has read it: no CTA-wide barrier anywhere in the loop;
- **ping-pong** (FA3's inter-warpgroup schedule): the consumers take turns to issue their products, so the tensor
  cores run one warpgroup's products while the other computes its softmax.

Shared memory: Q ``[2, 64, 128]`` and K, V ``[2, 128, 128]`` each (160 KiB, one program an SM). Only the
diagonal tile is masked; value rows past a sequence's end (they may hold anything, NaN included) are zeroed in
shared memory before their product. Scope (:func:`unsupported` says why an input is outside it, and the CUDA
plugin's provider then runs the shared Triton kernel): bf16/fp16, head 128, causal without window or soft cap,
cache blocks of 16 to 64 tokens (several TMA boxes a key tile, gathered through the block table) or a multiple of
128 whose rows of ``kv_heads * 128`` features are contiguous (any block stride: separate or interleaved caches), queries whose heads are contiguous (a fused QKV slice included).
Measured on one H200 against cuDNN (``docs/results/attention-h200.md``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

__all__ = ["HEAD", "TILE", "hopper_prefill_attention", "unsupported"]

HEAD = 128  # the head size the kernel serves
TILE = 128  # query rows a program (two consumer warpgroups of 64) and keys a tile
ROWS = 64  # query rows a consumer warpgroup
CONSUMER_REGS = 240
PRODUCER_REGS = 24
LOG2E = 1.4426950408889634


@gluon.jit
def _load_kv_tile(desc, table, j, seq_len, bar, dst, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
                  HEAD: gl.constexpr, kv_col):  # fmt: skip
    """Key or value tile ``j`` of the sequence into ``dst`` (``[1, TILE, HEAD]``), completing on ``bar``.

    Blocks of ``TILE`` tokens or a multiple: one TMA box inside one block. Smaller blocks: one box a block, the
    tile's blocks gathered from the block table. A box wholly past the sequence's end (the last tile only) loads
    the sequence's last block again, never an entry past its row: its rows are masked by the consumers (keys by
    position, values zeroed in the last tile), and the barrier always expects a whole tile's bytes.
    """
    BOX: gl.constexpr = TILE if BLOCK_SIZE >= TILE else BLOCK_SIZE
    BOXES: gl.constexpr = TILE // BOX
    start = j * TILE
    mbarrier.expect(bar, TILE * HEAD * 2)
    if BOXES == 1:
        block = gl.load(table + start // BLOCK_SIZE).to(gl.int32)  # int64 tables too; TMA coordinates are int32
        tma.async_copy_global_to_shared(desc, [block, start % BLOCK_SIZE, kv_col], bar, dst)
    else:
        last = (seq_len - 1) // BOX  # the sequence's last block
        for b in gl.static_range(BOXES):
            block = gl.load(table + gl.minimum(start // BOX + b, last)).to(gl.int32)
            tma.async_copy_global_to_shared(desc, [block, 0, kv_col], bar, dst.slice(b * BOX, BOX, dim=1))


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
             table, q_row, q_col, kv_col, n_tiles, seq_len, BLOCK_SIZE: gl.constexpr, TILE: gl.constexpr,
             ROWS: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """The producer warp: Q's two halves, then key and value tile ``j`` into buffer ``j % 2`` once it is free."""
    mbarrier.expect(q_bar, 2 * ROWS * HEAD * 2)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + ROWS, q_col], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        stage = j % 2
        free = ((j // 2) & 1) ^ 1  # a fresh barrier counts as freed once: the first two waits pass at once
        mbarrier.wait(k_empty.index(stage), free)
        _load_kv_tile(k_desc, table, j, seq_len, k_full.index(stage), k_smem.index(stage), BLOCK_SIZE, TILE, HEAD,
                      kv_col)  # fmt: skip
        mbarrier.wait(v_empty.index(stage), free)
        _load_kv_tile(v_desc, table, j, seq_len, v_full.index(stage), v_smem.index(stage), BLOCK_SIZE, TILE, HEAD,
                      kv_col)  # fmt: skip


@gluon.jit
def _consume(WG: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, v_clean, turns,
             PINGPONG: gl.constexpr, out_ptr, q_start, q_len, m0, first, seq_len, n_tiles, n_full, qk_scale,
             stride_ot, stride_oh, head, TILE: gl.constexpr, ROWS: gl.constexpr, HEAD: gl.constexpr):  # fmt: skip
    """Consumer warpgroup ``WG``: query rows ``m0 + WG * ROWS`` on, FA3's intra-warpgroup overlap, then the store.

    With ``PINGPONG`` the two warpgroups take turns to issue their products: round ``r`` of warpgroup ``WG`` waits
    for ``turns[WG]`` and hands the turn over once its products are issued.
    """
    dtype: gl.constexpr = q_smem.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    cols_of: gl.constexpr = gl.SliceLayout(0, mma)

    q_pos = first + WG * ROWS + gl.arange(0, ROWS, layout=rows_of)
    offs_n = gl.arange(0, TILE, layout=cols_of)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_of)
    l_i = gl.full([ROWS], 0.0, gl.float32, layout=rows_of)
    acc = gl.zeros([ROWS, HEAD], gl.float32, layout=mma)
    q = q_smem.index(WG)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_full.index(0), 0)
    _take_turn(turns, WG, 0, PINGPONG)
    s_tok = warpgroup_mma(q, _key_operand(k_smem, 0, TILE, HEAD), gl.zeros([ROWS, TILE], gl.float32, mma),
                          use_acc=False, is_async=True)  # fmt: skip
    _pass_turn(turns, WG, PINGPONG)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    mbarrier.arrive(k_empty.index(0))
    p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, 0, seq_len, n_full, TILE)
    p_prev = gl.convert_layout(p.to(dtype), p_operand)
    for j in range(1, n_tiles):
        stage = j % 2
        prev = 1 - stage
        mbarrier.wait(k_full.index(stage), (j // 2) & 1)
        mbarrier.wait(v_full.index(prev), ((j - 1) // 2) & 1)
        _take_turn(turns, WG, j, PINGPONG)
        s_tok = warpgroup_mma(q, _key_operand(k_smem, stage, TILE, HEAD), gl.zeros([ROWS, TILE], gl.float32, mma),
                              use_acc=False, is_async=True)  # fmt: skip
        acc_tok = warpgroup_mma(p_prev, _value_operand(v_smem, prev, TILE, HEAD), acc, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # the scores are in; P V still runs
        mbarrier.arrive(k_empty.index(stage))
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, j, seq_len, n_full, TILE)
        acc, p_prev = warpgroup_mma_wait(0, deps=[acc_tok, p_prev])
        mbarrier.arrive(v_empty.index(prev))
        acc = acc * gl.expand_dims(alpha, 1)
        p_prev = gl.convert_layout(p.to(dtype), p_operand)

    last = (n_tiles - 1) % 2
    mbarrier.wait(v_full.index(last), ((n_tiles - 1) // 2) & 1)
    if n_tiles * TILE > seq_len:  # value rows past the end may hold NaN: warpgroup 0 zeroes them for both
        if WG == 0:
            _zero_rows_past(_value_operand(v_smem, last, TILE, HEAD), n_tiles - 1, seq_len, TILE, HEAD)
            mbarrier.arrive(v_clean)
        else:
            mbarrier.wait(v_clean, 0)
    _take_turn(turns, WG, n_tiles, PINGPONG)
    acc_tok = warpgroup_mma(p_prev, _value_operand(v_smem, last, TILE, HEAD), acc, is_async=True)
    _pass_turn(turns, WG, PINGPONG)
    acc = warpgroup_mma_wait(0, deps=[acc_tok])

    out = acc / gl.expand_dims(gl.where(l_i > 0, l_i, 1.0), 1)
    rows = m0 + WG * ROWS + gl.arange(0, ROWS, layout=rows_of)
    cols = gl.arange(0, HEAD, layout=cols_of)
    ptrs = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
    gl.store(ptrs + gl.expand_dims(cols, 0), out.to(dtype), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _key_operand(k_smem, stage, TILE: gl.constexpr, HEAD: gl.constexpr):
    """Key buffer ``stage`` (a ``[1, TILE, HEAD]`` TMA box) as the ``[HEAD, TILE]`` operand of ``Q K^T``."""
    return k_smem.index(stage).reshape([TILE, HEAD]).permute((1, 0))


@gluon.jit
def _value_operand(v_smem, stage, TILE: gl.constexpr, HEAD: gl.constexpr):
    return v_smem.index(stage).reshape([TILE, HEAD])


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, tile, seq_len, n_full, TILE: gl.constexpr):
    """Probabilities of one tile's scores (base 2, unnormalised), the new maxima and sums, and the rescale."""
    if tile >= n_full:  # the diagonal: keys after a row's position (or past the sequence) are not seen
        k_pos = tile * TILE + offs_n
        seen = (gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1)) & gl.expand_dims(k_pos < seq_len, 0)
        s = gl.where(seen, s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row past the queries sees nothing
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


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
def _zero_rows_past(v_tile, tile, seq_len, TILE: gl.constexpr, HEAD: gl.constexpr):
    """Zero the value rows of the sequence's last tile past its end (one warpgroup's stores, then its fence). Only
    the last key tile can reach past the end: the loop's tiles end at or before the last query's position."""
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    v = v_tile.load(blocked)
    k_pos = tile * TILE + gl.arange(0, TILE, layout=gl.SliceLayout(1, blocked))
    v_tile.store(gl.where(gl.expand_dims(k_pos < seq_len, 1), v, gl.zeros_like(v)))
    fence_async_shared()  # the tensor cores read shared memory through the async proxy
    gl.thread_barrier()


@gluon.jit
def _store_zeros(out_ptr, q_start, q_len, m0, head, stride_ot, stride_oh, TILE: gl.constexpr, HEAD: gl.constexpr):
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + gl.arange(0, TILE, layout=gl.SliceLayout(1, blocked))
    cols = gl.arange(0, HEAD, layout=gl.SliceLayout(0, blocked))
    ptrs = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
    zeros = gl.zeros([TILE, HEAD], out_ptr.dtype.element_ty, layout=blocked)
    gl.store(ptrs + gl.expand_dims(cols, 0), zeros, mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _hopper_prefill_kernel(q_desc, k_desc, v_desc, out_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
                           qk_scale, stride_ot, stride_oh, stride_bt, GROUP: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                           TILE: gl.constexpr, ROWS: gl.constexpr, HEAD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PRODUCER_REGS: gl.constexpr, PINGPONG: gl.constexpr):  # fmt: skip
    dtype: gl.constexpr = q_desc.dtype
    head = gl.program_id(0)
    seq = gl.program_id(1)
    q_block = gl.num_programs(2) - 1 - gl.program_id(2)  # every head's heaviest query block first
    q_start = gl.load(cu_seqlens_q_ptr + seq).to(gl.int32)  # TMA coordinates are int32 (int64 metadata too)
    q_len = gl.load(cu_seqlens_q_ptr + seq + 1).to(gl.int32) - q_start
    m0 = q_block * TILE
    if m0 < q_len:
        seq_len = gl.load(seq_lens_ptr + seq).to(gl.int32)
        ctx = seq_len - q_len
        first = ctx + m0
        last = ctx + gl.minimum(m0 + TILE, q_len) - 1
        n_tiles = (last + TILE) // TILE  # key tiles some row sees
        n_full = (first + 1) // TILE  # ... and those every row sees whole
        if n_tiles > 0:
            table = block_tables_ptr + seq.to(gl.int64) * stride_bt
            q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [2, 1, TILE, HEAD], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [2, 1, TILE, HEAD], v_desc.layout)
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
                            stride_ot, stride_oh, head, TILE, ROWS, HEAD)),
                (_consume, (1, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty, v_clean, turns,
                            PINGPONG, out_ptr, q_start, q_len, m0, first, seq_len, n_tiles, n_full, qk_scale,
                            stride_ot, stride_oh, head, TILE, ROWS, HEAD)),
                (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_full, k_empty, v_full, v_empty,
                            table, q_start + m0, head * HEAD, (head // GROUP) * HEAD, n_tiles, seq_len, BLOCK_SIZE,
                            TILE, ROWS, HEAD)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
            # fmt: on
        else:  # a padded sequence (no cached token): the contract wants zeros
            _store_zeros(out_ptr, q_start, q_len, m0, head, stride_ot, stride_oh, TILE, HEAD)


def unsupported(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    max_query_len: int = 0,
) -> str | None:
    """Why the kernel cannot serve these (already validated) inputs, or None. Reads shapes and strides only."""
    if query.dtype not in (torch.bfloat16, torch.float16):
        return f"bf16 or fp16 only (got {query.dtype})"
    num_tokens, num_heads, head = query.shape
    if head != HEAD:
        return f"head {HEAD} only (got {head})"
    if sliding_window or soft_cap:
        return "causal attention without a window or soft cap only"
    if triton.cdiv(min(max_query_len, num_tokens), TILE) > 65535:  # the grid's z extent
        return f"at most {65535 * TILE} query tokens a sequence"
    size = query.element_size()
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _, block_size, kv_heads, _ = cache.shape
        stride_block, stride_slot, stride_head, stride_feature = cache.stride()
        if block_size % TILE and (TILE % block_size or block_size < 16):  # 8-token boxes: 16 a tile, and spills
            return f"cache blocks of 16, 32, 64 or a multiple of {TILE} tokens only (got {block_size})"
        if (stride_feature, stride_head, stride_slot) != (1, HEAD, kv_heads * HEAD):
            return f"{name}: a block's rows of kv_heads * head features contiguous only (strides {cache.stride()})"
        if stride_block < block_size * kv_heads * HEAD or (stride_block * size) % 16 or cache.data_ptr() % 16:
            return f"{name}: blocks apart and 16-byte aligned only (block stride {stride_block})"
    if query.stride(-1) != 1 or query.stride(1) != HEAD or query.stride(0) < num_heads * HEAD:
        return f"a query whose heads are contiguous rows only (strides {query.stride()})"
    if (query.stride(0) * size) % 16 or query.data_ptr() % 16:
        return "a 16-byte aligned query only"
    return None


@functools.cache
def _layouts(dtype: torch.dtype, box: int) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """Shared-memory layouts of the query and key/value boxes (made once: they cost microseconds a launch)."""
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return (
        gl.NVMMASharedLayout.get_default_for([ROWS, HEAD], element),
        gl.NVMMASharedLayout.get_default_for([1, box, HEAD], element),
    )


def hopper_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len,
                             scale, *, pingpong: bool = True) -> torch.Tensor:  # fmt: skip
    """``prefill_attention`` (causal, no window or soft cap) for inputs :func:`unsupported` accepts, already checked
    by the op's validation. ``pingpong=False`` turns the consumers' turn-taking off (a measurement knob)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_tokens, num_heads, _ = query.shape
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    box = min(block_size, TILE)  # smaller blocks: a box a block, several a tile
    q_layout, kv_layout = _layouts(query.dtype, box)
    q_desc = TensorDescriptor(query, [num_tokens, num_heads * HEAD], [query.stride(0), 1], [ROWS, HEAD], q_layout)
    kv_shape = [num_blocks, block_size, kv_heads * HEAD]
    k_desc, v_desc = (
        TensorDescriptor(cache, kv_shape, [cache.stride(0), kv_heads * HEAD, 1], [1, box, HEAD], kv_layout)
        for cache in (key_cache, value_cache)
    )
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    grid = (num_heads, seq_lens.shape[0], triton.cdiv(min(max_query_len, num_tokens), TILE))
    _hopper_prefill_kernel[grid](
        q_desc, k_desc, v_desc, out, block_tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(),
        float(scale) * LOG2E, out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, TILE=TILE, ROWS=ROWS, HEAD=HEAD,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, PINGPONG=pingpong, num_warps=4,
    )  # fmt: skip
    return out
