"""Paged KV-cache ops: write K/V by slot, decode attention, and prefill attention over a paged prefix.

The cache layout, shared by every provider: ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_size]``. Token ``t`` of a sequence lives in block
``block_tables[seq, t // block_size]`` at offset ``t % block_size``; its *slot* is
``block * block_size + offset``. Sequences are described by ``seq_lens`` (tokens in the cache,
including the ones being computed) and, for prefill, ``cu_seqlens_q`` (offsets of each sequence's
query tokens in the packed batch). Query heads map to KV heads in groups (GQA):
head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Padding: graph capture runs a batch padded to a fixed size. A padded sequence has ``seq_lens[i] ==
0``: its output rows are exactly zero, and neither its block-table row (stale entries, whatever
the last batch left there) nor any cache slot is read for it. Slot -1 in ``slot_mapping`` is a
padded token: nothing is written for it.

Layout: ``query``, ``key``, ``value`` may be strided views (slices of a fused QKV projection), and
so may the caches (``key_cache = kv[:, 0]`` of a ``[num_blocks, 2, block_size, ...]`` buffer, or a
head-major cache: stored ``[num_blocks, num_kv_heads, block_size, head_size]`` and seen through the
contract's shape, as a platform with ``kv_head_major`` allocates it); outputs are new contiguous tensors;
the caches are written through their views only. The last dimension of every tensor is contiguous.
"""

from __future__ import annotations

import math

import torch

from ..errors import OpInputError
from ._checks import (
    INDEX_DTYPES,
    check_float,
    check_index,
    check_int,
    check_same,
    check_values_in,
    check_writable,
    first_bad,
    reads_values,
)
from ._op import ErrorInput, IndexedTable, Op, SampleInput, Tolerance, Variants

_CACHE_DIMS = ("num_blocks", "block_size", "num_kv_heads", "head_size")


def check_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Refuse caches outside the layout; return ``(num_blocks, block_size, num_kv_heads, head_size)``."""
    check_float(op, "key_cache", key_cache)
    check_float(op, "value_cache", value_cache)
    check_same(op, "value_cache", value_cache, "key_cache", key_cache)
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise OpInputError(
            f"{op}: key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_size]"
        )
    if min(key_cache.shape) < 1:
        empty = [name for name, size in zip(_CACHE_DIMS, key_cache.shape, strict=True) if size < 1]
        raise OpInputError(
            f"{op}: key_cache has shape {tuple(key_cache.shape)}, with {' and '.join(empty)} 0; every dimension of "
            "[num_blocks, block_size, num_kv_heads, head_size] must be at least 1"
        )
    return tuple(key_cache.shape)  # type: ignore[return-value]


def _check_heads(op: str, query: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    if query.dim() != 3 or query.shape[-1] != head_size:
        raise OpInputError(
            f"{op}: query has shape {tuple(query.shape)}; it must be [tokens, num_heads, {head_size}] (head_size of the cache)"
        )
    if query.shape[1] < 1 or query.shape[1] % num_kv_heads:
        raise OpInputError(
            f"{op}: {query.shape[1]} query heads is not a multiple of the cache's {num_kv_heads} KV heads; "
            "num_heads must be a positive multiple of num_kv_heads (GQA groups of equal size)"
        )


def _check_scale_softcap_window(op: str, scale: float, sliding_window: int, soft_cap: float) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise OpInputError(f"{op}: scale must be a positive finite float (usually head_size ** -0.5), got {scale!r}")
    check_int(op, "sliding_window", sliding_window, 0, "0 = no window")
    if (
        isinstance(soft_cap, bool)
        or not isinstance(soft_cap, (int, float))
        or not math.isfinite(soft_cap)
        or soft_cap < 0
    ):
        raise OpInputError(f"{op}: soft_cap must be a finite float >= 0 (0 = no cap), got {soft_cap!r}")


def _check_tables(
    op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """Values: every length fits its block-table row, and every entry a sequence reads names a block of the caches.

    Entries past a sequence's last block (and a padded sequence's whole row) are never read, so
    they may hold anything: stale blocks of an earlier batch, -1.
    """
    width = block_tables.shape[1]
    capacity = width * block_size
    check_values_in(
        op,
        "seq_lens",
        seq_lens,
        0,
        capacity + 1,
        f"a sequence holds 0 (padding) to {capacity} tokens, the {width} columns of block_tables times the "
        f"block_size {block_size}; widen block_tables or fix the length",
    )
    used = torch.arange(width, device=block_tables.device)[None, :] * block_size < seq_lens[:, None]
    at = first_bad(used & ((block_tables < 0) | (block_tables >= num_blocks)))
    if at is not None:
        seq, column = at
        raise OpInputError(
            f"{op}: block_tables[{seq}, {column}] is {int(block_tables[at])}, outside the caches' blocks "
            f"[0, {num_blocks}); sequence {seq} ({int(seq_lens[seq])} tokens) reads that entry, so it must name "
            "one of the sequence's blocks in the cache"
        )


# ------------------------------------------------------------------------------------------------
# reshape_and_cache
# ------------------------------------------------------------------------------------------------


def check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Refuse arguments outside ``reshape_and_cache``'s contract."""
    op = "reshape_and_cache"
    _, _, kv_heads, head_size = check_cache(op, key_cache, value_cache)
    check_float(op, "key", key)
    check_float(op, "value", value)
    check_same(op, "key", key, "key_cache", key_cache)
    check_same(op, "value", value, "key_cache", key_cache)
    if key.dim() != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (kv_heads, head_size):
        raise OpInputError(
            f"{op}: key {tuple(key.shape)} and value {tuple(value.shape)} must both be [tokens, {kv_heads}, {head_size}] "
            "(the cache's KV heads and head size)"
        )
    check_index(op, "slot_mapping", slot_mapping, 1, "key", key)
    if slot_mapping.shape[0] != key.shape[0]:
        raise OpInputError(f"{op}: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    check_writable(op, "key_cache", key_cache)
    check_writable(op, "value_cache", value_cache)
    if reads_values(slot_mapping):
        _check_slots(op, slot_mapping, key_cache.shape[0], key_cache.shape[1])


def _check_slots(op: str, slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Values: each slot is -1 (a padded token) or a slot of the caches, and no two tokens share one."""
    slots = num_blocks * block_size
    check_values_in(
        op,
        "slot_mapping",
        slot_mapping,
        -1,
        slots,
        f"a slot is -1 (a padded token, not written) or block * block_size + offset within the caches' "
        f"{num_blocks} blocks of {block_size}",
    )
    kept, order = slot_mapping.sort(stable=True)
    at = first_bad((kept[1:] == kept[:-1]) & (kept[1:] >= 0))
    if at is not None:
        first, second = sorted((int(order[at[0]]), int(order[at[0] + 1])))
        raise OpInputError(
            f"{op}: tokens {first} and {second} both write slot {int(kept[at[0]])} (slot_mapping); which one the "
            "cache keeps is undefined: give every token its own slot, or -1 for padding"
        )


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s key and value into slot ``slot_mapping[t]`` of the caches.

    Slot -1 marks a padded token: nothing is written for it, in any slot (slot 0 and the last slot
    included). ``key`` and ``value`` may be views (slices of a fused QKV projection), and so may the
    caches; only the slots named are written.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


# ------------------------------------------------------------------------------------------------
# paged_attention (decode) and prefill_attention
# ------------------------------------------------------------------------------------------------


#: Queries attended together in :func:`_attend`: their scores stay small enough for the CPU's caches,
#: and each chunk reads only the keys its positions can see (a long causal prefill does half the work).
_QUERY_CHUNK = 256


def _attend(
    query: torch.Tensor,
    q_pos: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Queries ``[num_seqs, q_len, num_heads, head_size]`` at positions ``q_pos`` ``[num_seqs, q_len]`` attend
    causally to their sequence's cached keys; a query that sees no key (a position < 0) gets 0.

    Scores, softmax and the PV product are in float32 (float64 stays); the probabilities are rounded
    to the query's dtype before the PV product, as tensor-core kernels round them. One sequence at a
    time, over its own tokens only: nothing past ``seq_lens[i]`` is read, whatever the cache holds there.
    """
    out = query.new_zeros(query.shape)
    block_size = key_cache.shape[1]
    for i, n in enumerate(seq_lens.tolist()):
        if n <= 0:  # a padded sequence: its rows stay 0
            continue
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        keys = key_cache[blocks].flatten(0, 1)[:n]  # [key, kv head, dim]
        values = value_cache[blocks].flatten(0, 1)[:n]
        for start in range(0, query.shape[1], _QUERY_CHUNK):
            rows = slice(start, start + _QUERY_CHUNK)
            pos = q_pos[i, rows]
            last = int(pos.max()) + 1  # keys past every query's position are never seen
            first = max(int(pos[pos >= 0].min()) - sliding_window + 1, 0) if sliding_window > 0 and last > 0 else 0
            if last <= 0:
                continue
            out[i, rows] = _attend_keys(
                query[i, rows], pos - first, keys[first:last], values[first:last], scale, sliding_window, soft_cap
            )
    return out


def _attend_keys(query, pos, keys, values, scale, sliding_window, soft_cap) -> torch.Tensor:
    """Queries ``[q, heads, dim]`` at positions ``pos`` (counted from ``keys[0]``) over ``keys``/``values`` ``[k, kv heads, dim]``."""
    compute = torch.promote_types(query.dtype, torch.float32)
    q_len, kv_heads = query.shape[0], keys.shape[1]
    group = query.shape[1] // kv_heads
    # [kv head, group * query, dim]: a KV head's queries side by side, each KV head one matrix product
    q = query.to(compute).unflatten(1, (kv_heads, group)).permute(1, 2, 0, 3).flatten(1, 2)
    scores = torch.bmm(q, keys.to(compute).permute(1, 2, 0)) * scale  # [kv head, group * query, key]
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos = torch.arange(keys.shape[0], device=query.device)
    seen = k_pos[None, :] <= pos[:, None]  # [query, key]
    if sliding_window > 0:
        seen &= k_pos[None, :] > pos[:, None] - sliding_window
    seen = seen.repeat(group, 1)  # as the rows of ``scores``: group-major, then query
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    probs = torch.where(seen.any(dim=-1, keepdim=True), probs, 0.0).to(query.dtype).to(compute)
    attended = torch.bmm(probs, values.to(compute).transpose(0, 1))  # [kv head, group * query, dim]
    return attended.unflatten(1, (group, q_len)).permute(2, 0, 1, 3).flatten(1, 2).to(query.dtype)


def check_paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
) -> None:
    """Refuse arguments outside ``paged_attention``'s contract."""
    op = "paged_attention"
    _, _, kv_heads, head_size = check_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    check_same(op, "query", query, "key_cache", key_cache)
    _check_paged_batch(
        op, query, key_cache, kv_heads, head_size, block_tables, seq_lens, scale, sliding_window, soft_cap
    )


def _check_paged_batch(
    op, query, key_cache, kv_heads, head_size, block_tables, seq_lens, scale, sliding_window, soft_cap
) -> None:  # fmt: skip
    """``paged_attention``'s checks once its caches and query are checked (shared with ``paged_attention_fp8``)."""
    _check_heads(op, query, kv_heads, head_size)
    check_index(op, "block_tables", block_tables, 2, "query", query)
    check_index(op, "seq_lens", seq_lens, 1, "query", query)
    if block_tables.shape[0] != query.shape[0] or seq_lens.shape[0] != query.shape[0]:
        raise OpInputError(
            f"{op}: {query.shape[0]} queries (one per sequence) but block_tables has {block_tables.shape[0]} rows "
            f"and seq_lens {seq_lens.shape[0]} entries"
        )
    _check_scale_softcap_window(op, scale, sliding_window, soft_cap)
    if reads_values(block_tables, seq_lens):
        _check_tables(op, block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its ``seq_lens[i]`` cached tokens.

    ``query`` is ``[num_seqs, num_heads, head_size]``; the query is the sequence's last token
    (position ``seq_lens[i] - 1``), whose K/V are already in the cache. ``soft_cap > 0`` caps
    scores as ``soft_cap * tanh(score / soft_cap)``; ``sliding_window > 0`` keeps only the
    ``sliding_window`` most recent tokens. Softmax in float32 (see :func:`_attend`); output
    ``[num_seqs, num_heads, head_size]``. A padded sequence (``seq_lens[i] == 0``) gets zeros.
    """
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    return decode_attend(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)


def decode_attend(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
) -> torch.Tensor:
    """:func:`paged_attention_reference` without its checks (the caches may be wider than ``query``: FP8 dequantised)."""
    q_pos = (seq_lens.long() - 1)[:, None]  # the last token; -1 (sees nothing) for a padded sequence
    out = _attend(
        query[:, None], q_pos, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
    )
    return out[:, 0].contiguous()


def check_prefill_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    max_query_len,
    scale,
    sliding_window=0,
    soft_cap=0.0,
) -> None:
    """Refuse arguments outside ``prefill_attention``'s contract."""
    op = "prefill_attention"
    _, _, kv_heads, head_size = check_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    check_same(op, "query", query, "key_cache", key_cache)
    _check_prefill_batch(op, query, key_cache, kv_heads, head_size, block_tables, cu_seqlens_q, seq_lens,
                         max_query_len, scale, sliding_window, soft_cap)  # fmt: skip


def _check_prefill_batch(
    op, query, key_cache, kv_heads, head_size, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
    sliding_window, soft_cap,
) -> None:  # fmt: skip
    """``prefill_attention``'s checks once its caches and query are checked (shared with ``prefill_attention_fp8``)."""
    _check_heads(op, query, kv_heads, head_size)
    check_index(op, "block_tables", block_tables, 2, "query", query)
    check_index(op, "cu_seqlens_q", cu_seqlens_q, 1, "query", query)
    check_index(op, "seq_lens", seq_lens, 1, "query", query)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise OpInputError(
            f"{op}: {seq_lens.shape[0]} sequences need cu_seqlens_q of {seq_lens.shape[0] + 1} entries and as many "
            f"block_tables rows; got {cu_seqlens_q.shape[0]} and {block_tables.shape[0]}"
        )
    check_int(op, "max_query_len", max_query_len, 1, "the longest sequence's query tokens")
    _check_scale_softcap_window(op, scale, sliding_window, soft_cap)
    if reads_values(block_tables, cu_seqlens_q, seq_lens):
        _check_tables(op, block_tables, seq_lens, key_cache.shape[0], key_cache.shape[1])
        _check_query_offsets(op, cu_seqlens_q, seq_lens, query.shape[0], max_query_len)


def _check_query_offsets(
    op: str, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, tokens: int, max_query_len: int
) -> None:
    """Values: ``cu_seqlens_q`` starts at 0, never decreases, ends at ``query``'s token count; each sequence's query
    tokens fit ``max_query_len`` and, unless it is padding (``seq_lens`` 0), its cached tokens."""
    starts = cu_seqlens_q.long()
    if int(starts[0]) != 0:
        raise OpInputError(f"{op}: cu_seqlens_q[0] is {int(starts[0])}; the first sequence's queries start at row 0")
    q_lens = starts[1:] - starts[:-1]
    at = first_bad(q_lens < 0)
    if at is not None:
        i = at[0]
        raise OpInputError(
            f"{op}: cu_seqlens_q decreases from {int(starts[i])} to {int(starts[i + 1])} (entries {i} and {i + 1}); "
            "it holds the running total of the sequences' query tokens"
        )
    if int(starts[-1]) != tokens:
        raise OpInputError(
            f"{op}: cu_seqlens_q ends at {int(starts[-1])} but query holds {tokens} tokens; the offsets count "
            "query rows, so the last one is query.shape[0] (padding rows belong to a sequence of seq_lens 0)"
        )
    at = first_bad(q_lens > max_query_len)
    if at is not None:
        raise OpInputError(
            f"{op}: sequence {at[0]} has {int(q_lens[at])} query tokens but max_query_len is {max_query_len}; pass "
            "the longest sequence's query length (kernels size their grids by it)"
        )
    at = first_bad((q_lens > seq_lens.long()) & (seq_lens > 0))
    if at is not None:
        raise OpInputError(
            f"{op}: sequence {at[0]} has {int(q_lens[at])} query tokens but seq_lens {int(seq_lens[at])}; its "
            "queries are the last of its cached tokens, so seq_lens counts them too (0 marks a padded sequence)"
        )


def prefill_attention_reference(
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
    """Causal attention for a packed batch of sequences whose K/V (prefix and new tokens) are in the cache.

    Sequence ``i`` has query tokens ``query[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` (``q_len`` of them),
    the last ``q_len`` of its ``seq_lens[i]`` cached tokens: query ``j`` sits at position
    ``seq_lens[i] - q_len + j`` and sees keys up to that position. A prefix already in the cache
    (prefix caching, chunked prefill) is simply ``seq_lens[i] > q_len``. ``max_query_len`` bounds
    every ``q_len`` (it sizes kernel grids without a device-to-host read). Output is ``query``'s shape;
    ``query`` holds ``cu_seqlens_q[-1]`` tokens (checked under validation only: that reads the device). A padded
    sequence (``seq_lens[i] == 0``) may own query rows (padding tokens): they get zeros.
    """
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
    return prefill_attend(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, soft_cap
    )


def prefill_attend(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, soft_cap
) -> torch.Tensor:
    """:func:`prefill_attention_reference` without its checks (the caches may be wider than ``query``)."""
    starts, lens = cu_seqlens_q.long(), seq_lens.long()
    q_lens = starts[1:] - starts[:-1]
    # queries laid out [sequence, row in it] (padded to the longest); row j sits at lens - q_lens + j
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=query.device), q_lens)
    row = torch.arange(seq.shape[0], device=query.device) - starts[seq]
    longest = int(q_lens.max()) if q_lens.numel() else 0
    q = query.new_zeros((lens.shape[0], longest, *query.shape[1:]))
    q[seq, row] = query[: seq.shape[0]]
    j = torch.arange(longest, device=query.device)[None, :]
    q_pos = torch.where((j < q_lens[:, None]) & (lens[:, None] > 0), lens[:, None] - q_lens[:, None] + j, -1)
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    out[: seq.shape[0]] = _attend(
        q, q_pos, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
    )[seq, row]
    return out


# ------------------------------------------------------------------------------------------------
# Samples: random caches whose unused slots hold NaN, so a kernel that reads past a sequence shows it
# ------------------------------------------------------------------------------------------------


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values stored ``[num_blocks, num_kv_heads, block_size, head_size]``, seen as the contract's shape."""
    stored = torch.empty(
        (cache.shape[0], cache.shape[2], cache.shape[1], cache.shape[3]), dtype=cache.dtype, device=cache.device
    )
    stored.copy_(cache.permute(0, 2, 1, 3))
    return stored.permute(0, 2, 1, 3)


def _paged_batch(gen, device, dtype, seq_lens, kv_heads, head_size, block_size, interleaved=False, head_major=False):
    """Caches with the sequences' blocks scattered at random, every slot no sequence owns set to NaN.

    Unused block-table entries (and a padded sequence's whole row) point at a NaN block. With
    ``interleaved``, the caches are ``kv[:, 0]`` and ``kv[:, 1]`` of one ``[num_blocks, 2, ...]``
    buffer: views whose blocks are two blocks apart. With ``head_major``, each is stored head before
    token (:func:`_head_major`): a KV head's rows of a block side by side.
    """
    need = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    spare = int(order[-1])
    tables = torch.full((len(seq_lens), max(need) + 1), spare, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        blocks = order[used : used + need[i]]
        used += need[i]
        tables[i, : need[i]] = blocks.to(torch.int32)
        owned.view(-1, block_size)[blocks] = (
            torch.arange(block_size)[None, :] < (n - torch.arange(need[i]) * block_size)[:, None]
        )
    key_cache[~owned] = float("nan")
    value_cache[~owned] = float("nan")
    if interleaved:
        kv = torch.stack([key_cache, value_cache], dim=1).to(device, dtype)
        key_cache, value_cache = kv[:, 0], kv[:, 1]
    else:
        key_cache, value_cache = key_cache.to(device, dtype), value_cache.to(device, dtype)
    if head_major:
        key_cache, value_cache = _head_major(key_cache), _head_major(value_cache)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return key_cache, value_cache, tables.to(device), lens.to(device)


def _queries(gen, device, dtype, tokens, heads, kv_heads, head_size, scale, fused):
    """Random queries ``[tokens, heads, head_size]``; with ``fused``, a view into a [tokens, (heads + 2 * kv_heads) * head_size] QKV."""
    q = scale * torch.randn(tokens, heads, head_size, generator=gen)
    if not fused:
        return q.to(device, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(device, dtype)
    view = qkv[:, : heads * head_size].unflatten(-1, (heads, head_size))
    view.copy_(q)
    return view


def _decode_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, seq_lens, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0, **kw):
        kc, vc, tables, lens = _paged_batch(
            gen, device, dtype, seq_lens, kv_heads, head_size, block_size, kw.get("interleaved", False),
            kw.get("head_major", False),
        )  # fmt: skip
        q_scale, fused = kw.get("q_scale", 1.0), kw.get("fused", False)
        q = _queries(gen, device, dtype, len(seq_lens), heads, kv_heads, head_size, q_scale, fused)
        scale = kw.get("scale", head_size**-0.5)
        return SampleInput(label, (q, kc, vc, tables, lens, scale, window, cap), kw.get("large", False))

    boundaries = [1, 15, 16, 17, 33]
    batch = torch.randint(1, 81, (256,), generator=gen).tolist()
    sixty_five = torch.randint(1, 40, (65,), generator=gen).tolist()
    return [
        case("block boundaries, gqa 1", boundaries, 4, 4),
        case("gqa 4", boundaries, 8, 2),
        case("gqa 8", [5, 40], 8, 1),
        case("sliding window 8", boundaries, 4, 2, window=8),
        case("soft cap 30", boundaries, 4, 2, cap=30.0),
        # a cap far above the scores leaves them as they are: tanh(x) = (1 - e) / (1 + e) cancels there
        case("soft cap 1e6, scores unbent", boundaries, 4, 2, cap=1e6),
        case("llama3-8b decode", [1, 129, 511, 1000], 32, 8, head_size=128),
        # 128-token blocks hold whole key tiles (the CUDA platform's default: its kernels load them with TMA)
        case("llama3-8b decode, block size 128", [1, 129, 300, 1000], 32, 8, head_size=128, block_size=128),
        case(
            "block size 128, window 100, interleaved caches",
            [5, 200, 129],
            8,
            2,
            block_size=128,
            window=100,
            interleaved=True,
        ),
        case("gqa 16", [5, 40, 77], 32, 2),
        case("head size 80, block size 8", [7, 8, 9, 41], 4, 2, head_size=80, block_size=8),
        case("head size 96, block size 32", [31, 32, 33, 100], 4, 2, head_size=96, block_size=32),
        case("head size 256", [17, 60], 8, 2, head_size=256),
        case("scale 0.3, not head_size ** -0.5", boundaries, 4, 2, scale=0.3),
        # scores of standard deviation 4: a cap of 5 bends most of them
        case("soft cap 5 on sharp scores", boundaries, 4, 2, cap=5.0, q_scale=4.0),
        # Sharp softmax over long contexts, 8192 output elements: softmax in 16 bits loses precision here.
        case("sharp attention", [64, 300, 517, 1000, 33, 129, 700, 1500], 8, 2, head_size=128, q_scale=4.0),
        case("padded batch (seq_lens 0)", [17, 0, 33, 0], 4, 2),
        case("query a slice of a fused qkv, interleaved caches", boundaries, 4, 2, fused=True, interleaved=True),
        # a KV head's rows of a block side by side (a kv_head_major platform's cache): token and head strides swap
        case("head-major caches, gqa 2", [*boundaries, 100], 8, 4, head_major=True),
        case(
            "head-major caches, head 128, block size 128, window 100",
            [5, 200],
            8,
            2,
            head_size=128,
            block_size=128,
            window=100,
            head_major=True,
        ),
        case("one sequence", [37], 4, 2),
        # a batch of one over a context that ends inside a key partition (split-KV kernels' last partial split)
        case("one sequence, 1000-token context", [1000], 8, 2, head_size=128),
        case("65 sequences (past a 64-row tile)", sixty_five, 4, 2),
        # multi-head attention: 32 KV heads of 128, 4096-wide cache rows
        case("llama2-7b mha (32 kv heads x 128)", [1, 65, 200], 32, 32, head_size=128, large=True),
        case("soft cap 5 with sliding window 8, sharp scores", boundaries, 4, 2, window=8, cap=5.0, q_scale=4.0),
        # a small cap over long contexts: hundreds of keys outside the window, each of weight zero, not exp(-cap)
        case("soft cap 2 with sliding window 8, long contexts", [100, 517], 4, 2, window=8, cap=2.0),
        case("llama3-8b, 4096-token context", [4096], 32, 8, head_size=128, large=True),
        case("contexts beyond 8k", [8200, 16411], 2, 1, large=True),
        case("batch of 256 sequences", batch, 4, 1, large=True),
    ]


def _prefill_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, q_lens, prefixes, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0, **kw):
        padded = kw.get("padded", ())  # sequences of seq_lens 0 that still own query rows (padding tokens)
        seq_lens = [0 if i in padded else p + q for i, (p, q) in enumerate(zip(prefixes, q_lens, strict=True))]
        kc, vc, tables, lens = _paged_batch(
            gen, device, dtype, seq_lens, kv_heads, head_size, block_size, kw.get("interleaved", False),
            kw.get("head_major", False),
        )  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q_scale, fused = kw.get("q_scale", 1.0), kw.get("fused", False)
        q = _queries(gen, device, dtype, sum(q_lens), heads, kv_heads, head_size, q_scale, fused)
        scale = kw.get("scale", head_size**-0.5)
        args = (q, kc, vc, tables, cu, lens, max(q_lens), scale, window, cap)
        return SampleInput(label, args, kw.get("large", False))

    return [
        case("block boundaries, gqa 1", [1, 5, 16, 17], [0, 0, 0, 0], 4, 4),
        case("paged prefix (chunked prefill)", [3, 8, 1], [16, 21, 40], 4, 2),
        case("gqa 8", [7, 20], [0, 5], 8, 1),
        case("sliding window 8", [20, 3], [0, 30], 4, 2, window=8),
        case("soft cap 30", [9, 17], [4, 0], 4, 2, cap=30.0),
        case("soft cap 1e6, scores unbent", [9, 17], [4, 0], 4, 2, cap=1e6),
        case("llama3-8b prefill", [128, 37], [0, 64], 32, 8, head_size=128),
        case("llama3-8b prefill, block size 128", [200, 37], [0, 100], 32, 8, head_size=128, block_size=128),
        # the shapes Hopper's prefill kernel serves (head 128, blocks of 128 tokens or a multiple): several key
        # tiles, ragged ends, a padded sequence, blocks holding two tiles, a fused query over interleaved caches
        case(
            "head 128, block size 128: ragged, prefixes, gqa 8",
            [129, 1, 260],
            [255, 0, 130],
            8,
            1,
            head_size=128,
            block_size=128,
        ),
        case(
            "head 128, block size 128: a padded sequence",
            [130, 5],
            [0, 0],
            4,
            2,
            head_size=128,
            block_size=128,
            padded=(1,),
        ),
        case(
            "head 128, block size 256, gqa 1: fused query, interleaved caches",
            [257, 31],
            [0, 99],
            2,
            2,
            head_size=128,
            block_size=256,
            fused=True,
            interleaved=True,
        ),
        case(
            "block size 128, window 50, interleaved caches",
            [150, 9],
            [0, 130],
            8,
            2,
            block_size=128,
            window=50,
            interleaved=True,
        ),
        case("gqa 16", [7, 20], [0, 5], 16, 1),
        case("head size 80, block size 8", [9, 4], [7, 0], 4, 2, head_size=80, block_size=8),
        case("head size 96, block size 32", [33, 5], [0, 40], 4, 2, head_size=96, block_size=32),
        case("head size 256", [12, 5], [3, 20], 4, 2, head_size=256),
        case("scale 0.3, not head_size ** -0.5", [9, 17], [4, 0], 4, 2, scale=0.3),
        case("soft cap 5 on sharp scores", [9, 17], [4, 0], 4, 2, cap=5.0, q_scale=4.0),
        case("sharp attention", [100, 37], [0, 200], 8, 2, q_scale=4.0),
        case("padded sequences (seq_lens 0)", [5, 0, 3, 2], [4, 0, 0, 0], 4, 2, padded=(1, 3)),
        case(
            "query a slice of a fused qkv, interleaved caches",
            [3, 8, 1],
            [16, 21, 40],
            4,
            2,
            fused=True,
            interleaved=True,
        ),
        case("one sequence of one token", [1], [0], 4, 2),
        case("head-major caches, paged prefix, gqa 2", [3, 20, 1], [16, 21, 40], 8, 4, head_major=True),
        case("65 sequences (past a 64-row tile)", [1, 2, 3, 4, 5] * 13, [0, 7, 16, 3, 30] * 13, 4, 2),
        case("llama2-7b mha (32 kv heads x 128)", [65, 3], [0, 40], 32, 32, head_size=128, large=True),
        case("soft cap 5 with sliding window 8, sharp scores", [20, 3], [0, 30], 4, 2, window=8, cap=5.0, q_scale=4.0),
        case("2048 tokens after a cached 1024-token prefix", [2048], [1024], 2, 1, large=True),
    ]


def _cache_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(
        label, tokens, num_blocks, block_size, kv_heads, head_size, skip=0, ends_free=False, views=False, heads=False
    ):
        shape = (num_blocks, block_size, kv_heads, head_size)
        if views:  # caches kv[:, 0], kv[:, 1] of one buffer; key and value slices of a fused qkv
            kv = torch.randn(num_blocks, 2, *shape[1:], generator=gen).to(device, dtype)
            kc, vc = kv[:, 0], kv[:, 1]
            qkv = torch.randn(tokens, 4 * kv_heads * head_size, generator=gen).to(device, dtype)
            k = qkv[:, 2 * kv_heads * head_size : 3 * kv_heads * head_size].unflatten(-1, (kv_heads, head_size))
            v = qkv[:, 3 * kv_heads * head_size :].unflatten(-1, (kv_heads, head_size))
        else:
            kc = torch.randn(shape, generator=gen).to(device, dtype)
            vc = torch.randn(shape, generator=gen).to(device, dtype)
            k = torch.randn(tokens, kv_heads, head_size, generator=gen).to(device, dtype)
            v = torch.randn(tokens, kv_heads, head_size, generator=gen).to(device, dtype)
        if heads:  # head-major caches: a kv_head_major platform's
            kc, vc = _head_major(kc), _head_major(vc)
        # with ends_free, no real token goes to slot 0 or the last slot: a padded token's stray write shows there
        first, end = (1, num_blocks * block_size - 1) if ends_free else (0, num_blocks * block_size)
        slots = first + torch.randperm(end - first, generator=gen)[:tokens]
        slots[torch.randperm(tokens, generator=gen)[:skip]] = -1
        return SampleInput(label, (k, v, kc, vc, slots.to(device)))

    return [
        case("small", 10, 4, 16, 2, 64),
        case("padding slots -1", 12, 4, 16, 2, 64, skip=3),
        case("padding slots -1, first and last slots untouched", 12, 4, 16, 2, 64, skip=4, ends_free=True),
        case("block size 8, head size 80", 20, 6, 8, 2, 80, skip=2),
        case("block size 32, head size 256", 40, 4, 32, 1, 256, skip=3),
        case("key and value slices of a fused qkv, interleaved caches", 9, 4, 16, 2, 64, skip=2, views=True),
        case("head-major caches", 20, 4, 16, 4, 64, skip=2, heads=True),
        case("one token", 1, 4, 16, 2, 64),
        case("65 tokens (past a 64-row tile)", 65, 8, 16, 2, 64, skip=2),
        # multi-head attention: 32 KV heads of 128, 4096-wide cache rows
        case("llama2-7b mha (32 kv heads x 128)", 65, 8, 16, 32, 128),
        case("llama3-8b decode", 64, 64, 16, 8, 128),
        case("llama3-8b prefill", 512, 64, 16, 8, 128),
    ]


def _zero_rows(out: torch.Tensor, rows: torch.Tensor, what: str) -> str | None:
    """``None`` when ``out[rows]`` is exactly zero; else what is not."""
    if not isinstance(out, torch.Tensor) or not bool(rows.any()):
        return None
    got = out.detach().cpu()[rows.cpu()]
    bad = got.ne(0) | got.isnan()
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} elements of the rows of {what} are not exactly 0 (first at {index} of those rows: "
        f"{got[index].item():.6g}); a padded sequence's output is zero"
    )


def _decode_padding_zero(args: tuple, out: torch.Tensor) -> str | None:
    return _zero_rows(out, args[4] == 0, "padded sequences (seq_lens 0)")


def _prefill_padding_zero(args: tuple, out: torch.Tensor) -> str | None:
    cu, lens = args[4].long().cpu(), args[5].cpu()
    q_lens = cu[1:] - cu[:-1]
    padded_token = torch.repeat_interleave(lens == 0, q_lens)
    rows = torch.zeros(out.shape[0], dtype=torch.bool)
    rows[: padded_token.shape[0]] = padded_token
    return _zero_rows(out, rows, "padded sequences (seq_lens 0)")


def _decode_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)
    q = torch.randn(2, 4, 64, device=device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    return [
        ErrorInput(
            "wrong head size",
            (torch.randn(2, 4, 32, device=device), kc, kc, tables, lens, 0.1),
            "head_size of the cache",
        ),
        ErrorInput(
            "heads not a multiple of kv heads",
            (torch.randn(2, 3, 64, device=device), kc, kc, tables, lens, 0.1),
            "not a multiple",
        ),
        ErrorInput("float block tables", (q, kc, kc, tables.float(), lens, 0.1), "block_tables must be"),
        ErrorInput("seq_lens of wrong length", (q, kc, kc, tables, lens[:1], 0.1), "one per sequence"),
        ErrorInput("query of another dtype", (q.half(), kc, kc, tables, lens, 0.1), "cast them to one dtype"),
        ErrorInput("negative sliding window", (q, kc, kc, tables, lens, 0.1, -4), "sliding_window"),
    ]


def _prefill_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)
    q = torch.randn(6, 4, 64, device=device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=device)
    lens = torch.tensor([2, 4], dtype=torch.int32, device=device)
    return [
        ErrorInput(
            "wrong head size",
            (torch.randn(6, 4, 32, device=device), kc, kc, tables, cu, lens, 4, 0.1),
            "head_size of the cache",
        ),
        ErrorInput("cu_seqlens_q too short", (q, kc, kc, tables, cu[:2], lens, 4, 0.1), "cu_seqlens_q of 3 entries"),
        ErrorInput("max_query_len of zero", (q, kc, kc, tables, cu, lens, 0, 0.1), "max_query_len"),
        ErrorInput("negative soft cap", (q, kc, kc, tables, cu, lens, 4, 0.1, 0, -1.0), "soft_cap"),
    ]


def _cache_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)
    k = torch.randn(3, 2, 64, device=device)
    slots = torch.arange(3, device=device)
    return [
        ErrorInput(
            "key with wrong head size",
            (torch.randn(3, 2, 32, device=device), k, kc, kc, slots),
            "must both be [tokens, 2, 64]",
        ),
        ErrorInput("slot count mismatch", (k, k, kc, kc, slots[:2]), "2 slots for 3 tokens"),
        ErrorInput("float slots", (k, k, kc, kc, slots.float()), "slot_mapping must be"),
        ErrorInput("3-D cache", (k, k, kc[0], kc[0], slots), "num_blocks, block_size, num_kv_heads, head_size"),
        ErrorInput(
            "an expanded cache", (k, k, kc[:1].expand(4, -1, -1, -1), kc, slots), "key_cache is an expanded view"
        ),
    ]


def _cache_value_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)  # 64 slots
    k = torch.randn(3, 2, 64, device=device)

    def slots(*values: int) -> torch.Tensor:
        return torch.tensor(values, device=device)

    return [
        ErrorInput("slot past the cache", (k, k, kc, kc, slots(0, 64, 5)), "slot_mapping[1] is 64, outside [-1, 64)"),
        ErrorInput("slot -2", (k, k, kc, kc, slots(-2, 1, 5)), "slot_mapping[0] is -2"),
        ErrorInput("two tokens, one slot", (k, k, kc, kc, slots(7, -1, 7)), "tokens 0 and 2 both write slot 7"),
    ]


def _decode_value_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)
    q = torch.randn(2, 4, 64, device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)

    def lens(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    bad_block = tables.clone()
    bad_block[1, 1] = 4
    return [
        ErrorInput("seq_lens past the block table", (q, kc, kc, tables, lens(3, 33), 0.1), "seq_lens[1] is 33"),
        ErrorInput("negative seq_lens", (q, kc, kc, tables, lens(-1, 5), 0.1), "seq_lens[0] is -1"),
        ErrorInput("block past the cache", (q, kc, kc, bad_block, lens(3, 17), 0.1), "block_tables[1, 1] is 4"),
        ErrorInput("negative block", (q, kc, kc, -tables - 1, lens(3, 0), 0.1), "block_tables[0, 0] is -1"),
    ]


def _prefill_value_errors(device: torch.device) -> list[ErrorInput]:
    kc = torch.randn(4, 16, 2, 64, device=device)
    q = torch.randn(6, 4, 64, device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    cu, lens = ints(0, 2, 6), ints(2, 4)
    bad_block = tables.clone()
    bad_block[0, 0] = 9
    return [
        ErrorInput("seq_lens past the block table", (q, kc, kc, tables, cu, ints(2, 40), 4, 0.1), "seq_lens[1] is 40"),
        ErrorInput("block past the cache", (q, kc, kc, bad_block, cu, lens, 4, 0.1), "block_tables[0, 0] is 9"),
        ErrorInput("cu_seqlens_q not from 0", (q, kc, kc, tables, ints(1, 2, 6), lens, 4, 0.1), "cu_seqlens_q[0] is 1"),
        ErrorInput("cu_seqlens_q decreasing", (q, kc, kc, tables, ints(0, 4, 2), ints(4, 4), 4, 0.1), "decreases"),
        ErrorInput("cu_seqlens_q past query", (q, kc, kc, tables, ints(0, 2, 7), ints(2, 5), 5, 0.1), "ends at 7"),
        ErrorInput("query rows past cu_seqlens_q", (q, kc, kc, tables, ints(0, 2, 5), ints(2, 3), 3, 0.1), "ends at 5"),
        ErrorInput("query longer than max_query_len", (q, kc, kc, tables, cu, lens, 3, 0.1), "max_query_len is 3"),
        ErrorInput("more queries than cached tokens", (q, kc, kc, tables, cu, ints(2, 3), 4, 0.1), "seq_lens 3"),
    ]


_ATTENTION_TOLERANCES = {
    torch.float32: Tolerance(1e-4, 1e-4, "online softmax rescales partial sums; summation order differs"),
    torch.bfloat16: Tolerance(1.5e-2, 2e-2, "probabilities are rounded to bfloat16 (8 bits) before the PV product"),
    torch.float16: Tolerance(2e-3, 4e-3, "probabilities are rounded to float16 (11 bits) before the PV product"),
}

reshape_and_cache = Op(
    name="reshape_and_cache",
    reference=reshape_and_cache_reference,
    tolerances={dtype: Tolerance(0.0, 0.0, "a cache write copies values exactly") for dtype in _ATTENTION_TOLERANCES},
    hand_samples=_cache_samples,
    errors=_cache_errors,
    value_errors=_cache_value_errors,
    mutates=("key_cache", "value_cache"),
    fake=lambda key, value, key_cache, value_cache, slot_mapping: None,
    variants=Variants(
        base="small",
        index={"slot_mapping": INDEX_DTYPES},
        tables=(IndexedTable("slot_mapping", ("key_cache", "value_cache"), dims=2),),
    ),
)

paged_attention = Op(
    name="paged_attention",
    reference=paged_attention_reference,
    tolerances=_ATTENTION_TOLERANCES,
    hand_samples=_decode_samples,
    errors=_decode_errors,
    value_errors=_decode_value_errors,
    fake=lambda query, *_args: query.new_empty(query.shape),
    invariant=_decode_padding_zero,
    variants=Variants(
        base="block boundaries, gqa 1",
        index={"block_tables": INDEX_DTYPES, "seq_lens": INDEX_DTYPES},
        tables=(IndexedTable("block_tables", ("key_cache", "value_cache")),),
    ),
)

prefill_attention = Op(
    name="prefill_attention",
    reference=prefill_attention_reference,
    tolerances=_ATTENTION_TOLERANCES,
    hand_samples=_prefill_samples,
    errors=_prefill_errors,
    value_errors=_prefill_value_errors,
    fake=lambda query, *_args: query.new_empty(query.shape),
    invariant=_prefill_padding_zero,
    variants=Variants(
        base="block boundaries, gqa 1",
        index={"block_tables": INDEX_DTYPES, "cu_seqlens_q": INDEX_DTYPES, "seq_lens": INDEX_DTYPES},
        tables=(IndexedTable("block_tables", ("key_cache", "value_cache")),),
    ),
)
