# ruff: noqa: N803  (Gluon's constexpr parameters and layouts are upper case)
"""EXPERIMENT (kept for the record): causal prefill over the paged cache in Gluon, with FlashAttention-3's
intra-warpgroup overlap. It ran correct on the H200 but 4-6% slower than the Triton kernel at 4k-16k tokens
(``docs/results/h200/probe-gluon-tma-h200-run1.txt``): every warp issues its own loads, so the compiler guards each
buffer's reuse with a CTA-wide ``bar.sync`` and the two warpgroups run in lockstep. Its warp-specialised successor,
``vllm_port_cuda.hopper_prefill``, is what the CUDA plugin binds on sm_90. ``dev/experiments/probe_hopper.py --sections gluon
--gluon tma`` checks this one against the op's reference, then times it.

Why Gluon: Triton 3.6 waits for every ``wgmma`` before the softmax touches its scores (``dev/sm90_stats.py``),
so no warp runs exponentials under its own tensor-core work; the shipped kernel gets its overlap only from a
second program on the SM and stops at 0.81-0.85x cuDNN (docs/results/attention-h200.md). Gluon (Triton's
explicit-layout dialect, ``triton.experimental.gluon``) exposes the asynchronous ``wgmma``, its waits, TMA and
``mbarrier`` directly, so the schedule is written out. Per key tile ``j`` (after the first), each of the two
warpgroups (64 query rows each) runs:

1. issue ``S_j = Q K_j^T`` (async);
2. issue ``O += P_{j-1} V_{j-1}`` (async; ``P`` from registers, ``O`` already rescaled for tile ``j - 1``);
3. wait until one product is left in flight: ``S_j`` is done, the ``P V`` product still runs, and key tile
   ``j``'s buffer is free: TMA starts loading key tile ``j + 2`` into it;
4. the online softmax of ``S_j`` (exp2, maxima, sums): *under the tensor cores' ``P V``*;
5. wait for ``P V``: value tile ``j - 1``'s buffer is free: TMA starts loading value tile ``j + 1`` into it;
6. rescale ``O`` by ``exp2(m_old - m_new)``.

Key and value tiles are double-buffered in shared memory, each buffer with its ``mbarrier`` (phase = the
buffer's use count mod 2). Q (128 rows), K and V tiles (128 keys) are TMA boxes of 2-D descriptors: the query
``[tokens, heads * 128]``, each cache ``[blocks * block_size, kv_heads * 128]`` (cache blocks must be contiguous
and a multiple of 128 tokens: the CUDA platform's 128-token blocks). Masked tiles (the diagonal) are masked in
registers; value rows past the sequence's end are zeroed in shared memory before their product (they may hold
anything, NaN included). Scope: bf16/fp16, head 128, causal, no window or soft cap. Not the FA3 producer warp
and ping-pong (``gl.warp_specialize``): the next step if this schedule measures well.
"""

from __future__ import annotations

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

from vllm_port_cuda.hopper_prefill import _online_softmax  # the shipped kernel's softmax step, the same math

__all__ = ["BLOCK_M", "BLOCK_N", "HEAD", "gluon_prefill", "supported"]

HEAD = 128
BLOCK_M = 128  # query rows a program: two warpgroups of 64
BLOCK_N = 128  # keys a tile (== HEAD: the score and output accumulators share one layout)
NUM_WARPS = 8
LOG2E = 1.4426950408889634


@gluon.jit
def _issue_tile_load(desc, row, col, smem, bar, NBYTES: gl.constexpr, pred):
    mbarrier.expect(bar, NBYTES, pred=pred)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem, pred=pred)


@gluon.jit
def _cache_row(table, tile, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Row of the 2-D cache view where key tile ``tile`` of the sequence starts."""
    start = tile * BLOCK_N
    block = gl.load(table + start // BLOCK_SIZE)
    return block * BLOCK_SIZE + start % BLOCK_SIZE


@gluon.jit
def _gluon_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: gl.constexpr,
    BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    HEAD: gl.constexpr,
):
    dtype: gl.constexpr = q_desc.dtype
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_N, 16])
    p_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, mma)
    cols_of: gl.constexpr = gl.SliceLayout(0, mma)
    tile_bytes: gl.constexpr = BLOCK_N * HEAD * 2

    # every head's heaviest query block first (the shipped kernel's "all_heads" order)
    head = gl.program_id(0)
    seq = gl.program_id(1)
    q_block = gl.num_programs(2) - 1 - gl.program_id(2)
    kv_head = head // GROUP
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
        table = block_tables_ptr + seq.to(gl.int64) * stride_bt
        col = kv_head * HEAD

        if n_tiles > 0:
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD], q_desc.layout)
            k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD], k_desc.layout)
            v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, HEAD], v_desc.layout)
            bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())  # q, k0, k1, v0, v1
            for i in gl.static_range(5):
                mbarrier.init(bars.index(i), count=1)
            fence_async_shared()  # the barriers' initialisation, visible to TMA
            gl.thread_barrier()  # ... and to every warp before any waits on them

            # prologue: Q, key tiles 0 and 1, value tile 0 (and 1 when it exists)
            _issue_tile_load(q_desc, q_start + m0, head * HEAD, q_smem, bars.index(0), BLOCK_M * HEAD * 2, True)
            _issue_tile_load(k_desc, _cache_row(table, 0, BLOCK_SIZE, BLOCK_N), col, k_smem.index(0), bars.index(1),
                             tile_bytes, True)  # fmt: skip
            _issue_tile_load(v_desc, _cache_row(table, 0, BLOCK_SIZE, BLOCK_N), col, v_smem.index(0), bars.index(3),
                             tile_bytes, True)  # fmt: skip
            has_1 = n_tiles > 1
            row_1 = _cache_row(table, gl.minimum(1, n_tiles - 1), BLOCK_SIZE, BLOCK_N)
            _issue_tile_load(k_desc, row_1, col, k_smem.index(1), bars.index(2), tile_bytes, has_1)
            _issue_tile_load(v_desc, row_1, col, v_smem.index(1), bars.index(4), tile_bytes, has_1)

            q_pos = first + gl.arange(0, BLOCK_M, layout=rows_of)
            offs_n = gl.arange(0, BLOCK_N, layout=cols_of)
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_of)
            l_i = gl.full([BLOCK_M], 0.0, gl.float32, layout=rows_of)
            acc = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=mma)

            # tile 0: its scores synchronously, then the loop keeps one P V product in flight
            mbarrier.wait(bars.index(0), 0)
            mbarrier.wait(bars.index(1), 0)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma),
                              use_acc=False)  # fmt: skip
            # key buffer 0 is free again: key tile 2 (the loop loads tiles 3 on, each two tiles ahead)
            _issue_tile_load(k_desc, _cache_row(table, gl.minimum(2, n_tiles - 1), BLOCK_SIZE, BLOCK_N), col,
                             k_smem.index(0), bars.index(1), tile_bytes, n_tiles > 2)  # fmt: skip
            p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, 0, seq_len, n_full, BLOCK_N)
            p_prev = gl.convert_layout(p.to(dtype), p_operand)
            for j in range(1, n_tiles):
                stage = j % 2
                prev = 1 - stage
                phase = (j // 2) & 1
                mbarrier.wait(bars.index(1 + stage), phase)
                s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)),
                                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma), use_acc=False, is_async=True)  # fmt: skip
                mbarrier.wait(bars.index(3 + prev), ((j - 1) // 2) & 1)  # tile j - 1 ends before the sequence does
                acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])  # the scores are in; P V still runs
                has_next2 = j + 2 < n_tiles
                _issue_tile_load(k_desc, _cache_row(table, gl.minimum(j + 2, n_tiles - 1), BLOCK_SIZE, BLOCK_N), col,
                                 k_smem.index(stage), bars.index(1 + stage), tile_bytes, has_next2)  # fmt: skip
                p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, qk_scale, q_pos, offs_n, j, seq_len, n_full, BLOCK_N)
                acc, p_prev = warpgroup_mma_wait(0, deps=[acc_tok, p_prev])  # P's registers stay live until here
                has_next1 = j + 1 < n_tiles
                _issue_tile_load(v_desc, _cache_row(table, gl.minimum(j + 1, n_tiles - 1), BLOCK_SIZE, BLOCK_N), col,
                                 v_smem.index(prev), bars.index(3 + prev), tile_bytes, has_next1)  # fmt: skip
                acc = acc * gl.expand_dims(alpha, 1)
                p_prev = gl.convert_layout(p.to(dtype), p_operand)
            last_stage = (n_tiles - 1) % 2
            mbarrier.wait(bars.index(3 + last_stage), ((n_tiles - 1) // 2) & 1)
            _zero_rows_past(v_smem.index(last_stage), n_tiles - 1, seq_len, BLOCK_N, HEAD)
            acc = warpgroup_mma(p_prev, v_smem.index(last_stage), acc)
            for i in gl.static_range(5):
                mbarrier.invalidate(bars.index(i))

            out = acc / gl.expand_dims(gl.where(l_i > 0, l_i, 1.0), 1)
        else:  # a padded sequence (no cached token): the contract wants zeros
            out = gl.zeros([BLOCK_M, HEAD], gl.float32, layout=mma)
        rows = m0 + gl.arange(0, BLOCK_M, layout=rows_of)
        cols = gl.arange(0, HEAD, layout=cols_of)
        ptrs = out_ptr + gl.expand_dims((q_start + rows).to(gl.int64) * stride_ot + head * stride_oh, 1)
        ptrs = ptrs + gl.expand_dims(cols, 0)
        gl.store(ptrs, out.to(dtype), mask=gl.expand_dims(rows < q_len, 1))


@gluon.jit
def _zero_rows_past(v_tile, tile, seq_len, BLOCK_N: gl.constexpr, HEAD: gl.constexpr):
    """Value rows of the sequence's last tile past its end may hold anything (NaN): 0 * NaN would reach O. Only the
    last key tile can reach past the end (the loop's tiles end at or before the last query's position)."""
    if (tile + 1) * BLOCK_N > seq_len:
        blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        v = v_tile.load(blocked)
        k_pos = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blocked))
        v_tile.store(gl.where(gl.expand_dims(k_pos < seq_len, 1), v, gl.zeros_like(v)))
        fence_async_shared()  # the tensor cores read shared memory through the async proxy
        gl.thread_barrier()


def supported(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> str | None:
    """Why this experiment cannot run these inputs, or None."""
    if query.device.type != "cuda" or torch.cuda.get_device_capability(query.device) < (9, 0):
        return f"an sm_90 or newer NVIDIA GPU only (got {query.device})"
    if query.dtype not in (torch.bfloat16, torch.float16) or query.shape[-1] != HEAD:
        return f"bf16/fp16 with head {HEAD} only (got {query.dtype}, head {query.shape[-1]})"
    if sliding_window or soft_cap:
        return "causal attention without window or soft cap only"
    _, block_size, kv_heads, head = key_cache.shape
    contiguous = (block_size * kv_heads * head, kv_heads * head, head, 1)
    if block_size % BLOCK_N or key_cache.stride() != contiguous or value_cache.stride() != contiguous:
        return f"contiguous key and value caches of blocks a multiple of {BLOCK_N} tokens only"
    if value_cache.shape != key_cache.shape or query.shape[1] % kv_heads:
        return f"caches of one shape and query heads a multiple of the {kv_heads} KV heads only"
    if query.stride(-1) != 1 or query.stride(1) != HEAD or query.stride(0) != query.shape[1] * HEAD:
        return "a contiguous query only"
    return None


def gluon_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
                  sliding_window=0, soft_cap=0.0) -> torch.Tensor:  # fmt: skip
    """``prefill_attention`` (the op's signature) by the experiment; raises ``ValueError`` outside its scope."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    why = supported(query, key_cache, value_cache, sliding_window, soft_cap)
    if why:
        raise ValueError(f"gluon_prefill: {why}; use the shipped kernel")
    num_tokens, num_heads, head = query.shape
    blocks, block_size, kv_heads, _ = key_cache.shape
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    dtype = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD], dtype)
    q2 = query.view(num_tokens, num_heads * head)
    q_desc = TensorDescriptor.from_tensor(q2, [BLOCK_M, HEAD], q_layout)
    k_desc = TensorDescriptor.from_tensor(
        key_cache.view(blocks * block_size, kv_heads * head), [BLOCK_N, HEAD], kv_layout
    )
    v_desc = TensorDescriptor.from_tensor(value_cache.view(blocks * block_size, kv_heads * head), [BLOCK_N, HEAD],
                                          kv_layout)  # fmt: skip
    grid = (num_heads, seq_lens.shape[0], triton.cdiv(max_query_len, BLOCK_M))
    _gluon_prefill_kernel[grid](
        q_desc, k_desc, v_desc, out, block_tables, cu_seqlens_q, seq_lens, float(scale) * LOG2E,
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=num_heads // kv_heads, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD=HEAD,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
