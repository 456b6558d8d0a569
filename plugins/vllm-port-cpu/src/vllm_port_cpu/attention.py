"""CPU providers of the paged KV-cache ops: cache writes, decode attention and prefill attention.

All sequences of a batch are handled at once: their K/V are gathered from the paged cache in whole
blocks through ``block_tables`` (one ``index_select`` per cache), padded to the longest sequence,
and attention runs batched over sequences with an additive mask (``scaled_dot_product_attention``'s
CPU flash kernel, which takes bfloat16/float16 as they are and accumulates in float32; explicit
float32 matmuls when a soft cap is asked for, which that kernel lacks). Scores, softmax and the PV
sums are computed in float32 for bfloat16/float16.

Cache slots past a sequence's end may hold anything, NaN included, and a masked NaN still poisons
a matmul. Whole blocks bring such slots along (a block's tail; a block the sequence does not own
reads block 0 instead of its table entry), so those positions are set to exactly 0 in the gathered
copy, by index: there are few of them, so this costs far less than the token-by-token gather it
replaces, and the mask gives them probability exactly 0.

A padded sequence (``seq_lens[i] == 0``, graph capture's batch padding) owns no token and its
block-table row may hold stale entries: it gathers block 0 instead of anything its row names, and
its output rows are set to exactly zero afterwards (whatever that block holds).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_port.ops import kv_fp8, provider
from vllm_port.ops.attention import check_paged_attention, check_prefill_attention, check_reshape_and_cache

__all__ = ["paged_attention", "prefill_attention", "reshape_and_cache"]


@provider("reshape_and_cache", name="cpu_reshape_and_cache", priority=10)
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long()
    kept = slots >= 0
    # Slot -1 skips a token (padding). Whether any does is read on the host, which on this platform is the
    # device itself (no graph is captured): the usual step writes every token as it is, else the kept ones.
    if not bool(kept.all()):
        slots, key, value = slots[kept], key[kept], value[kept]
    index = (slots // key_cache.shape[1], slots % key_cache.shape[1])  # (block, offset): any cache strides
    key_cache.index_put_(index, key)
    value_cache.index_put_(index, value)


def _context_blocks(seq_lens: torch.Tensor, block_size: int, table_width: int) -> int:
    # The one host read of these ops: the longest context sizes the gather. Engines pad block tables
    # far past it (to the model's maximum length), so gathering whole rows would cost much more.
    return min(table_width, max(1, -(-int(seq_lens.max()) // block_size)))


def _gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    blocks: int,
    compute: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0 .. blocks * block_size - 1`` of every sequence's K and V: ``[num_seqs, kv_heads, len, head_size]``.

    Whole blocks are gathered (one ``index_select`` per cache: a copy of contiguous block rows,
    several times faster than indexing token by token); a block the sequence does not own (past its
    end, or any block of a padded sequence) reads block 0 instead of its table entry. Positions at
    or past ``lens`` may then hold anything, NaN included, so they are set to exactly 0 in the
    gathered copy: masked scores and probabilities then meet only finite values.
    """
    num_seqs = block_tables.shape[0]
    block_size = key_cache.shape[1]
    owned = torch.arange(blocks, device=lens.device)[None, :] * block_size < lens[:, None]  # [num_seqs, blocks]
    table = torch.where(owned, block_tables[:, :blocks].long(), 0).reshape(-1)
    length = blocks * block_size
    # the positions to clear, as indices: few (a block's tail, a short sequence's unowned blocks), so
    # clearing them costs far less than a masked pass over the whole gathered context
    invalid = (torch.arange(length, device=lens.device)[None, :] >= lens[:, None]).reshape(-1).nonzero().squeeze(1)
    out = []
    for cache in (key_cache, value_cache):
        # contiguous and fresh either way (index_select's output, or its widened copy): safe to fill in place
        gathered = cache.index_select(0, table).to(compute)
        # one row per position, sized explicitly: -1 is ambiguous when nothing was gathered (a block table of no column)
        gathered.view(num_seqs * length, cache.shape[2] * cache.shape[3]).index_fill_(0, invalid, 0.0)
        out.append(gathered.view(num_seqs, length, *cache.shape[2:]).transpose(1, 2))
    return out[0], out[1]


def _compute_dtype(dtype: torch.dtype, soft_cap: float) -> torch.dtype:
    # scaled_dot_product_attention's CPU flash kernel takes bfloat16/float16 as they are and computes
    # scores, softmax and the PV sums in float32 itself; widening K/V first would cost a full pass
    # over the gathered context (most of a decode step's attention time). The explicit soft-cap
    # matmuls widen to float32.
    return dtype if soft_cap <= 0 else torch.promote_types(dtype, torch.float32)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _soft_capped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, soft_cap: float
) -> torch.Tensor:
    """``softmax(cap * tanh(q k^T * scale / cap), masked) v`` with explicit matmuls; q, k, v share leading dims."""
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    scores.masked_fill_(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


@provider("paged_attention", name="cpu_paged_attention", priority=10)
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    _, block_size, kv_heads, _ = key_cache.shape
    compute = _compute_dtype(query.dtype, soft_cap)
    lens = seq_lens.long()
    blocks = _context_blocks(lens, block_size, block_tables.shape[1])
    k_pos = torch.arange(blocks * block_size, device=query.device)[None, :]
    allowed = k_pos < lens[:, None]  # the query is the last token: it sees its whole context
    if sliding_window > 0:
        allowed &= k_pos > lens[:, None] - 1 - sliding_window
    k, v = _gather_kv(key_cache, value_cache, block_tables, lens, blocks, compute)
    # GQA without repeating K/V: a KV head's `group` query heads are one [group, head_size] query block
    q = query.to(compute).unflatten(1, (kv_heads, num_heads // kv_heads))  # [num_seqs, kv_heads, group, head_size]
    allowed = allowed[:, None, None, :]  # broadcast over KV heads and the group
    if soft_cap > 0:
        out = _soft_capped(q, k, v, allowed, float(scale), float(soft_cap))
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=_additive(allowed, compute), scale=float(scale))
    # a padded sequence (seq_lens 0) sees no key: exactly 0, whatever the slot it gathered holds
    out.masked_fill_((lens == 0)[:, None, None, None], 0.0)
    return out.reshape(num_seqs, num_heads, head_size).to(query.dtype)


@provider("prefill_attention", name="cpu_prefill_attention", priority=10)
def prefill_attention(
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
    check_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        cu_seqlens_q,
        seq_lens,
        max_query_len,
        scale,
        sliding_window,
        soft_cap,
    )
    tokens, num_heads, head_size = query.shape
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return torch.empty_like(query)
    _, block_size, kv_heads, _ = key_cache.shape
    device = query.device
    compute = _compute_dtype(query.dtype, soft_cap)
    lens, starts = seq_lens.long(), cu_seqlens_q.long()
    q_lens = starts[1:] - starts[:-1]
    # every packed token's sequence and its index among that sequence's queries
    seq_id = torch.repeat_interleave(torch.arange(num_seqs, device=device), q_lens, output_size=tokens)
    row = torch.arange(tokens, device=device) - starts[seq_id]
    # queries padded to [num_seqs, max_query_len]; query j of sequence i sits at lens[i] - q_lens[i] + j.
    # Padding rows are placed at the last position, so they always see a key; their output is dropped.
    q = query.new_zeros((num_seqs, max_query_len, num_heads, head_size), dtype=compute)
    q[seq_id, row] = query.to(compute)
    j = torch.arange(max_query_len, device=device)[None, :]
    q_pos = torch.minimum(lens[:, None] - q_lens[:, None] + j, lens[:, None] - 1)  # [num_seqs, max_query_len]
    blocks = _context_blocks(lens, block_size, block_tables.shape[1])
    k_pos = torch.arange(blocks * block_size, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]  # causal; only positions < lens, since q_pos < lens
    if sliding_window > 0:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    k, v = _gather_kv(key_cache, value_cache, block_tables, lens, blocks, compute)
    q = q.transpose(1, 2)  # [num_seqs, num_heads, max_query_len, head_size]
    allowed = allowed[:, None]  # [num_seqs, 1, max_query_len, context], broadcast over heads
    if soft_cap > 0:
        group = num_heads // kv_heads
        qg = q.unflatten(1, (kv_heads, group))  # [num_seqs, kv_heads, group, max_query_len, head_size]
        out = _soft_capped(qg, k[:, :, None], v[:, :, None], allowed[:, :, None], float(scale), float(soft_cap))
        out = out.flatten(1, 2)
    else:
        mask = _additive(allowed, compute)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=float(scale), enable_gqa=True)
    # the query rows of a padded sequence (seq_lens 0) see no key: exactly 0, whatever it gathered
    out.masked_fill_((lens == 0)[:, None, None, None], 0.0)
    return out.transpose(1, 2)[seq_id, row].to(query.dtype)


# ------------------------------------------------------------------------------------------------
# The FP8 cache (vllm_port.ops.kv_fp8): written in torch; read by dequantising the blocks in use to float32
# and running the float attention above on them (the host has no FP8 arithmetic; float32 keeps the scores
# as exact as the e4m3 values allow)
# ------------------------------------------------------------------------------------------------


@provider("reshape_and_cache_fp8", name="cpu_reshape_and_cache_fp8", priority=10)
def reshape_and_cache_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    kv_fp8.check_reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = kv_fp8.quantize_kv(key[keep], k_scale)
    value_cache[slots // block_size, slots % block_size] = kv_fp8.quantize_kv(value[keep], v_scale)


@provider("paged_attention_fp8", name="cpu_paged_attention_fp8", priority=10)
def paged_attention_fp8(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    kv_fp8.check_paged_attention_fp8(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window,
                                     soft_cap, k_scale, v_scale)  # fmt: skip
    k, v, tables = kv_fp8.compact_blocks(
        key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, torch.float32
    )
    out = paged_attention.fn(query.float(), k, v, tables, seq_lens, scale, sliding_window, soft_cap)
    return out.to(query.dtype)


@provider("prefill_attention_fp8", name="cpu_prefill_attention_fp8", priority=10)
def prefill_attention_fp8(
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    kv_fp8.check_prefill_attention_fp8(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                       max_query_len, scale, sliding_window, soft_cap, k_scale, v_scale)  # fmt: skip
    k, v, tables = kv_fp8.compact_blocks(
        key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, torch.float32
    )
    out = prefill_attention.fn(query.float(), k, v, tables, cu_seqlens_q, seq_lens, max_query_len, scale,
                            sliding_window, soft_cap)  # fmt: skip
    return out.to(query.dtype)
