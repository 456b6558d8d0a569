"""Paged KV-cache ops: write K/V by slot, decode attention, and prefill attention over a paged prefix.

The cache layout, shared by every provider: ``key_cache`` and ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_size]``. Token ``t`` of a sequence lives in block
``block_tables[seq, t // block_size]`` at offset ``t % block_size``; its *slot* is
``block * block_size + offset``. Sequences are described by ``seq_lens`` (tokens in the cache,
including the ones being computed) and, for prefill, ``cu_seqlens_q`` (offsets of each sequence's
query tokens in the packed batch). Query heads map to KV heads in groups (GQA):
head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math

import torch

from ..errors import OpInputError
from ._checks import check_float, check_same
from ._op import ErrorInput, Op, SampleInput, Tolerance


def _check_int(op: str, arg: str, value: object, dims: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int32, torch.int64) or value.dim() != dims:
        got = f"{value.dtype} of {value.dim()} dims" if isinstance(value, torch.Tensor) else type(value).__name__
        raise OpInputError(f"{op}: {arg} must be an int32 or int64 tensor of {dims} dims, got {got}")
    return value


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
    return tuple(key_cache.shape)  # type: ignore[return-value]


def _check_heads(op: str, query: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    if query.dim() != 3 or query.shape[-1] != head_size:
        raise OpInputError(
            f"{op}: query has shape {tuple(query.shape)}; it must be [tokens, num_heads, {head_size}] (head_size of the cache)"
        )
    if query.shape[1] % num_kv_heads:
        raise OpInputError(
            f"{op}: {query.shape[1]} query heads is not a multiple of the cache's {num_kv_heads} KV heads"
        )


def _check_scale_softcap_window(op: str, scale: float, sliding_window: int, soft_cap: float) -> None:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise OpInputError(f"{op}: scale must be a positive finite float (usually head_size ** -0.5), got {scale!r}")
    if not isinstance(sliding_window, int) or sliding_window < 0:
        raise OpInputError(f"{op}: sliding_window must be an int >= 0 (0 = no window), got {sliding_window!r}")
    if not isinstance(soft_cap, (int, float)) or not math.isfinite(soft_cap) or soft_cap < 0:
        raise OpInputError(f"{op}: soft_cap must be a finite float >= 0 (0 = no cap), got {soft_cap!r}")


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
    _check_int(op, "slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise OpInputError(f"{op}: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``t``'s key and value into slot ``slot_mapping[t]`` of the caches; slot -1 skips the token."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]


# ------------------------------------------------------------------------------------------------
# paged_attention (decode) and prefill_attention
# ------------------------------------------------------------------------------------------------


def _gather(cache: torch.Tensor, block_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache: ``[length, kv_heads, head_size]``."""
    block_size = cache.shape[1]
    blocks = block_row[: (length + block_size - 1) // block_size].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Causal attention of queries at positions ``q_pos`` over keys ``0..len(k)-1``, in float32 (float64 stays)."""
    compute = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // k.shape[1]
    k = k.to(compute).repeat_interleave(group, dim=1)
    v = v.to(compute).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), k) * scale
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos = torch.arange(k.shape[0], device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window > 0:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def check_paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
) -> None:
    """Refuse arguments outside ``paged_attention``'s contract."""
    op = "paged_attention"
    _, _, kv_heads, head_size = check_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    check_same(op, "query", query, "key_cache", key_cache)
    _check_heads(op, query, kv_heads, head_size)
    _check_int(op, "block_tables", block_tables, 2)
    _check_int(op, "seq_lens", seq_lens, 1)
    if block_tables.shape[0] != query.shape[0] or seq_lens.shape[0] != query.shape[0]:
        raise OpInputError(
            f"{op}: {query.shape[0]} queries (one per sequence) but block_tables has {block_tables.shape[0]} rows "
            f"and seq_lens {seq_lens.shape[0]} entries"
        )
    _check_scale_softcap_window(op, scale, sliding_window, soft_cap)


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
    ``sliding_window`` most recent tokens. Softmax in float32; output ``[num_seqs, num_heads, head_size]``.
    """
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    out = torch.empty_like(query)
    for i, length in enumerate(seq_lens.tolist()):
        k, v = _gather(key_cache, block_tables[i], length), _gather(value_cache, block_tables[i], length)
        pos = torch.tensor([length - 1], device=query.device)
        out[i] = _attend(query[i : i + 1], k, v, pos, scale, sliding_window, soft_cap)[0]
    return out


def check_prefill_attention(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, soft_cap
) -> None:
    """Refuse arguments outside ``prefill_attention``'s contract."""
    op = "prefill_attention"
    _, _, kv_heads, head_size = check_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    check_same(op, "query", query, "key_cache", key_cache)
    _check_heads(op, query, kv_heads, head_size)
    _check_int(op, "block_tables", block_tables, 2)
    _check_int(op, "cu_seqlens_q", cu_seqlens_q, 1)
    _check_int(op, "seq_lens", seq_lens, 1)
    if cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
        raise OpInputError(
            f"{op}: {seq_lens.shape[0]} sequences need cu_seqlens_q of {seq_lens.shape[0] + 1} entries and as many "
            f"block_tables rows; got {cu_seqlens_q.shape[0]} and {block_tables.shape[0]}"
        )
    if not isinstance(max_query_len, int) or max_query_len < 1:
        raise OpInputError(
            f"{op}: max_query_len must be a positive int (the longest sequence's query tokens), got {max_query_len!r}"
        )
    _check_scale_softcap_window(op, scale, sliding_window, soft_cap)


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
    every ``q_len`` (it sizes kernel grids without a device-to-host read). Output is ``query``'s shape.
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
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    for i, length in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        k, v = _gather(key_cache, block_tables[i], length), _gather(value_cache, block_tables[i], length)
        pos = torch.arange(length - (end - start), length, device=query.device)
        out[start:end] = _attend(query[start:end], k, v, pos, scale, sliding_window, soft_cap)
    return out


# ------------------------------------------------------------------------------------------------
# Samples: random caches whose unused slots hold NaN, so a kernel that reads past a sequence shows it
# ------------------------------------------------------------------------------------------------


def _paged_batch(gen, device, dtype, seq_lens, kv_heads, head_size, block_size):
    """Caches with the sequences' blocks scattered at random, every slot no sequence owns set to NaN."""
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
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return key_cache.to(device, dtype), value_cache.to(device, dtype), tables.to(device), lens.to(device)


def _decode_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, seq_lens, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0):
        kc, vc, tables, lens = _paged_batch(gen, device, dtype, seq_lens, kv_heads, head_size, block_size)
        q = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(device, dtype)
        return SampleInput(label, (q, kc, vc, tables, lens, head_size**-0.5, window, cap))

    boundaries = [1, 15, 16, 17, 33]
    return [
        case("block boundaries, gqa 1", boundaries, 4, 4),
        case("gqa 4", boundaries, 8, 2),
        case("gqa 8", [5, 40], 8, 1),
        case("sliding window 8", boundaries, 4, 2, window=8),
        case("soft cap 30", boundaries, 4, 2, cap=30.0),
        case("llama3-8b decode", [1, 129, 511, 1000], 32, 8, head_size=128),
        case("longest context", [4096], 32, 8, head_size=128),
    ]


def _prefill_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, q_lens, prefixes, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0):
        seq_lens = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
        kc, vc, tables, lens = _paged_batch(gen, device, dtype, seq_lens, kv_heads, head_size, block_size)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(device, dtype)
        return SampleInput(label, (q, kc, vc, tables, cu, lens, max(q_lens), head_size**-0.5, window, cap))

    return [
        case("block boundaries, gqa 1", [1, 5, 16, 17], [0, 0, 0, 0], 4, 4),
        case("paged prefix (chunked prefill)", [3, 8, 1], [16, 21, 40], 4, 2),
        case("gqa 8", [7, 20], [0, 5], 8, 1),
        case("sliding window 8", [20, 3], [0, 30], 4, 2, window=8),
        case("soft cap 30", [9, 17], [4, 0], 4, 2, cap=30.0),
        case("llama3-8b prefill", [128, 37], [0, 64], 32, 8, head_size=128),
    ]


def _cache_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, tokens, num_blocks, block_size, kv_heads, head_size, skip=0):
        shape = (num_blocks, block_size, kv_heads, head_size)
        kc, vc = (
            torch.randn(shape, generator=gen).to(device, dtype),
            torch.randn(shape, generator=gen).to(device, dtype),
        )
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[:skip] = -1
        k = torch.randn(tokens, kv_heads, head_size, generator=gen).to(device, dtype)
        v = torch.randn(tokens, kv_heads, head_size, generator=gen).to(device, dtype)
        return SampleInput(label, (k, v, kc, vc, slots.to(device)))

    return [
        case("small", 10, 4, 16, 2, 64),
        case("padding slots -1", 12, 4, 16, 2, 64, skip=3),
        case("llama3-8b decode", 64, 64, 16, 8, 128),
        case("llama3-8b prefill", 512, 64, 16, 8, 128),
    ]


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
    samples=_cache_samples,
    errors=_cache_errors,
    mutates=("key_cache", "value_cache"),
    fake=lambda key, value, key_cache, value_cache, slot_mapping: None,
)

paged_attention = Op(
    name="paged_attention",
    reference=paged_attention_reference,
    tolerances=_ATTENTION_TOLERANCES,
    samples=_decode_samples,
    errors=_decode_errors,
    fake=lambda query, *_args: torch.empty_like(query),
)

prefill_attention = Op(
    name="prefill_attention",
    reference=prefill_attention_reference,
    tolerances=_ATTENTION_TOLERANCES,
    samples=_prefill_samples,
    errors=_prefill_errors,
    fake=lambda query, *_args: torch.empty_like(query),
)
