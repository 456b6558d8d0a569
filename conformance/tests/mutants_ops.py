"""Mutants of the contract ops: providers that each carry one realistic kernel bug.

One platform plugin holds them all (one ``vllm-port certify`` run). Each mutant is written the way a
vendor kernel goes wrong, emulated in torch: the op's input check first (as the contract asks), then
the computation with one planted bug. Each claims the one dtype its bug shows in, to keep the run
short. The first five are the broken providers the suite caught from the start; the rest come from
issue 11's classes (precision, shape branches, stray writes, strides) and from the classes the suite
caught when vendors' plugins were first tried (GQA mapping, a dropped partial block, ...).
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

SOURCE = '''
import torch
import torch.nn.functional as F

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.activation import gelu_and_mul_reference, silu_and_mul_reference
from vllm_port.ops.attention import (
    paged_attention_reference,
    prefill_attention_reference,
    reshape_and_cache_reference,
)
from vllm_port.ops.checks import (
    check_embedding,
    check_fused_add_rms_norm,
    check_gelu_and_mul,
    check_linear,
    check_paged_attention,
    check_prefill_attention,
    check_reshape_and_cache,
    check_rms_norm,
    check_rotary_embedding,
    check_silu_and_mul,
)
from vllm_port.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from vllm_port.ops.rotary import rotary_embedding_reference


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="mutant-ops", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def _norm(x, variance, weight, epsilon):
    """The reference's last step: normalise in float32, round to x's dtype, scale."""
    return (x.float() * torch.rsqrt(variance.float() + epsilon)).to(x.dtype) * weight


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap):
    return paged_attention_reference(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
    )


# ---- caught from the start --------------------------------------------------------------------


def eps_ignored(x, weight, epsilon):
    return rms_norm_reference(x, weight, 1e-6)  # the caller's epsilon never reaches the kernel


def nan_at_256(x, weight, epsilon):
    out = rms_norm_reference(x, weight, epsilon)
    return torch.full_like(out, float("nan")) if x.shape[-1] == 256 else out


def drops_last_token(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    # off by one at a block boundary: a sequence one token into a new block loses that token
    lens = torch.where((seq_lens % key_cache.shape[1] == 1) & (seq_lens > 1), seq_lens - 1, seq_lens)
    return _decode(query, key_cache, value_cache, block_tables, lens, scale, sliding_window, soft_cap)


def float32_out(x):
    return silu_and_mul_reference(x.float())  # forgets to cast back to the input dtype


def skips_last(key, value, key_cache, value_cache, slot_mapping):
    reshape_and_cache_reference(key[:-1], value[:-1], key_cache, value_cache, slot_mapping[:-1])


# ---- precision lost inside the tolerance --------------------------------------------------------


def bf16_tile_sum(x, weight, epsilon):
    check_rms_norm(x, weight, epsilon)
    squares = (x.float() ** 2).to(x.dtype)
    total = torch.zeros(*x.shape[:-1], 1, dtype=x.dtype)
    for start in range(0, x.shape[-1], 256):  # a bfloat16 accumulator, one 256-wide tile at a time
        total = total + squares[..., start : start + 256].sum(-1, keepdim=True)
    return _norm(x, total.float() / x.shape[-1], weight, epsilon)


def square_mean_in_dtype(x, weight, epsilon):
    check_rms_norm(x, weight, epsilon)
    return _norm(x, x.pow(2).mean(-1, keepdim=True), weight, epsilon)  # float16 squares overflow past 256


def bf16_softmax(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    out = torch.empty_like(query)
    block_size, group = key_cache.shape[1], query.shape[1] // key_cache.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : (n + block_size - 1) // block_size].long()
        k = key_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1)
        v = value_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", query[i], k) * scale  # scores and softmax in the input dtype
        if sliding_window > 0:
            scores[:, : max(0, n - sliding_window)] = float("-inf")
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        out[i] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), v) if n else 0
    return out


def rotate_in_dtype(positions, query, key, head_size, cos_sin_cache, is_neox):
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].to(query.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    for t in (query, key):
        heads = t.view(t.shape[0], -1, head_size)
        x1, x2 = (
            (heads[..., : rot // 2], heads[..., rot // 2 : rot])
            if is_neox
            else (heads[..., 0:rot:2], heads[..., 1:rot:2])
        )
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin  # every product and sum rounded to the input dtype
        x1.copy_(o1)
        x2.copy_(o2)


def bf16_split_k(x, weight, bias=None):
    check_linear(x, weight, bias)
    parts = torch.stack([F.linear(a, w) for a, w in zip(x.chunk(8, -1), weight.chunk(8, -1), strict=True)])
    out = parts[0]
    for p in parts[1:]:  # eight split-K partial products reduced in the output dtype
        out = out + p
    return out if bias is None else out + bias


# ---- shape-dependent branches -------------------------------------------------------------------


def chunked_wide_rows(x, weight, epsilon):
    check_rms_norm(x, weight, epsilon)
    if x.shape[-1] <= 8192:
        return rms_norm_reference(x, weight, epsilon)
    full = x.shape[-1] // 8192 * 8192  # the wide-row path sums whole 8192-wide chunks: the tail is dropped
    variance = x[..., :full].float().pow(2).sum(-1, keepdim=True) / x.shape[-1]
    return _norm(x, variance, weight, epsilon)


def wide_row_offset(x):
    d = check_silu_and_mul(x)
    if d <= 16384:
        return silu_and_mul_reference(x)
    up = d // 1024 * 1024  # the two-block path finds the up half at a 1024-aligned offset
    return (F.silu(x[..., :d]) * x[..., up : up + d]).contiguous()


def last_8192_keys(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    # a fixed 8192-key buffer: longer contexts silently become a sliding window
    window = 8192 if sliding_window == 0 else min(sliding_window, 8192)
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window, soft_cap)


def second_launch_tables(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    if query.shape[0] <= 128:
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # batches above 128 run in launches of 128; the later ones are not offset into the block tables
    tables = block_tables[torch.arange(query.shape[0]) % 128]
    return _decode(query, key_cache, value_cache, tables, seq_lens, scale, sliding_window, soft_cap)


def first_half_of_head_256(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    if query.shape[-1] != 256:
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # scores from the first 128-wide tile of the head only; the values are read whole
    half = torch.cat([query[..., :128], torch.zeros_like(query[..., 128:])], dim=-1)
    return _decode(half, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)


def power_of_two_head_dot(
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
):
    args = (
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
    check_prefill_attention(query, *args)
    head = query.shape[-1]
    tile = 1 << (head.bit_length() - 1)  # the score dot covers the largest power of two <= head size
    q = torch.cat([query[..., :tile], torch.zeros_like(query[..., tile:])], dim=-1) if tile != head else query
    return prefill_attention_reference(q, *args)


def block_offset_mod_16(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % min(block_size, 16)  # tuned for blocks of at most 16
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def group_capped_at_8(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    if group <= 8:
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # the kernel holds at most 8 query heads per KV head: larger groups map heads as if the group were 8
    kv_of = (torch.arange(heads) // 8).clamp(max=kv_heads - 1)
    out = torch.empty_like(query)
    for h in range(heads):
        one_kv = key_cache[:, :, kv_of[h] : kv_of[h] + 1], value_cache[:, :, kv_of[h] : kv_of[h] + 1]
        out[:, h : h + 1] = _decode(
            query[:, h : h + 1], *one_kv, block_tables, seq_lens, scale, sliding_window, soft_cap
        )
    return out


def fixed_scale(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    scale = query.shape[-1] ** -0.5  # the caller's scale is ignored
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)


def soft_cap_ignored(
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
):
    return prefill_attention_reference(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, 0.0
    )


def approximate_ignored(x, approximate="none"):
    check_gelu_and_mul(x, approximate)
    return gelu_and_mul_reference(x, "none")  # always the erf form


def long_prefill_without_prefix(
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
):
    args = (
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
    check_prefill_attention(query, *args)
    if max_query_len <= 1024:
        return prefill_attention_reference(query, *args)
    # the long-prompt path assumes no cached prefix: query j sits at position j, not prefix + j
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(seq_lens.dtype)
    return prefill_attention_reference(query, *args[:4], torch.minimum(q_lens, seq_lens), *args[5:])


# ---- writes where none belong -------------------------------------------------------------------


def wraps_padding(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long()  # -1 indexes the last slot, as Python and torch indexing do
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value


def clamps_padding(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.long().clamp(min=0)  # -1 lands in slot 0 (a clamp meant to keep indices in range)
    block_size = key_cache.shape[1]
    key_cache[slots // block_size, slots % block_size] = key
    value_cache[slots // block_size, slots % block_size] = value


def padded_as_one_token(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    # a padded sequence (seq_lens 0) is run as one token, read through its stale block-table row
    return _decode(query, key_cache, value_cache, block_tables, seq_lens.clamp(min=1), scale, sliding_window, soft_cap)


def leftover_padding_rows(
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
):
    args = (
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
    out = prefill_attention_reference(query, *args)
    # padded sequences' rows are never written: what the reused output buffer held stays (small leftovers)
    padded = torch.repeat_interleave(seq_lens == 0, (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long())
    out[: padded.shape[0]][padded] = 1e-4
    return out


# ---- strides ------------------------------------------------------------------------------------


def _contiguous_strides(shape):
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def reads_x_packed(x, weight, epsilon):
    check_rms_norm(x, weight, epsilon)
    packed = x.as_strided(x.shape, _contiguous_strides(x.shape))  # rows assumed hidden elements apart
    return rms_norm_reference(packed, weight, epsilon)


def rotates_a_copy(positions, query, key, head_size, cos_sin_cache, is_neox):
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    q, k = query.contiguous(), key.contiguous()  # a view is copied here, so the rotation never reaches it
    rotary_embedding_reference(positions, q, k, head_size, cos_sin_cache, is_neox)


def reads_weight_packed(x, weight, bias=None):
    check_linear(x, weight, bias)
    packed = weight.as_strided(weight.shape, _contiguous_strides(weight.shape))  # [out, in] row-major assumed
    return F.linear(x, packed, bias)


def cache_offsets_from_shape(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # slot addresses computed from the cache's shape, not its strides
    kc = key_cache.as_strided(key_cache.shape, _contiguous_strides(key_cache.shape))
    vc = value_cache.as_strided(value_cache.shape, _contiguous_strides(value_cache.shape))
    return _decode(query, kc, vc, block_tables, seq_lens, scale, sliding_window, soft_cap)


def cache_rows_in_token_order(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)

    # the block stride is read, a block's rows are assumed token before head: right for every cache but a head-major one
    def token_major(cache):
        _, _, kv_heads, head_size = cache.shape
        return cache.as_strided(cache.shape, (cache.stride(0), kv_heads * head_size, head_size, 1))

    return _decode(
        query, token_major(key_cache), token_major(value_cache), block_tables, seq_lens, scale, sliding_window, soft_cap
    )


def residual_written_packed(x, residual, weight, epsilon):
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    total = x + residual
    # the sum is stored as packed rows from the residual's first element, over whatever lies beyond the view
    residual.as_strided((total.numel(),), (1,), residual.storage_offset()).copy_(total.flatten())
    return rms_norm_reference(total, weight, epsilon)


# ---- classes the suite caught before ------------------------------------------------------------


def kv_head_by_modulo(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    # query head h reads KV head h % kv_heads instead of h // group: reorder heads so the reference does that
    order = torch.arange(heads).view(group, kv_heads).t().reshape(-1)
    out = _decode(query[:, order], key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    return out[:, torch.argsort(order)].contiguous()


def whole_blocks_only(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0):
    block_size = key_cache.shape[1]
    full = torch.where(
        seq_lens > block_size, seq_lens // block_size * block_size, seq_lens
    )  # the partial block is skipped
    return _decode(query, key_cache, value_cache, block_tables, full, scale, sliding_window, soft_cap)


def neox_pairs_always(positions, query, key, head_size, cos_sin_cache, is_neox):
    rotary_embedding_reference(positions, query, key, head_size, cos_sin_cache, True)  # GPT-J asked, NeoX done


def swapped_halves(x):
    d = check_silu_and_mul(x)
    return (F.silu(x[..., d:]) * x[..., :d]).contiguous()  # silu of the up half, times the gate


def residual_not_written(x, residual, weight, epsilon):
    return fused_add_rms_norm_reference(x, residual.clone(), weight, epsilon)  # the sum goes to a copy


def silu_in_place(x):
    d = check_silu_and_mul(x)
    return F.silu(x[..., :d], inplace=True) * x[..., d:]  # overwrites the caller's gate half


def column_major_out(x, approximate="none"):
    out = gelu_and_mul_reference(x, approximate)
    return out.t().contiguous().t() if out.dim() == 2 else out  # right values in a transposed layout


def one_sequence_at_a_time(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    length = int(seq_lens)  # written for one sequence: a batch raises
    return _decode(
        query, key_cache, value_cache, block_tables, seq_lens.new_full((1,), length), scale, sliding_window, soft_cap
    )


# ---- what the contract allows and the hand samples did not reach (issue 25) ----------------------


def int64_tables_as_int32(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    if block_tables.dtype == torch.int64:  # the launcher passes the pointer as int32*: every other word is read
        width = block_tables.shape[1]
        block_tables = block_tables.contiguous().view(torch.int32)[:, :width]
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)


def int64_cu_seqlens_as_int32(
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
):
    args = (key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, soft_cap)
    out = prefill_attention_reference(query, *args)
    if cu_seqlens_q.dtype == torch.int64:  # read as int32 words: [0, 0, c1, 0, ...] puts every query in sequence 0
        out[int(cu_seqlens_q[1]) :] = 0
    return out


def x_from_storage_start(x, weight, epsilon):
    check_rms_norm(x, weight, epsilon)
    # the launcher passes the storage's base pointer, not the view's: a view at an offset is read from its start
    return rms_norm_reference(x.as_strided(x.shape, x.stride(), 0), weight, epsilon)


def slots_from_storage_start(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    slots = slot_mapping.as_strided(slot_mapping.shape, slot_mapping.stride(), 0).long()  # the offset is dropped
    keep = (slots >= 0) & (slots < key_cache.shape[0] * key_cache.shape[1])  # what lies before it, where it fits
    block_size = key_cache.shape[1]
    key_cache[slots[keep] // block_size, slots[keep] % block_size] = key[keep]
    value_cache[slots[keep] // block_size, slots[keep] % block_size] = value[keep]


def floor_row_tiles(x):
    d = check_silu_and_mul(x)
    out = silu_and_mul_reference(x)
    rows = out.reshape(-1, d)
    tiles = max(1, rows.shape[0] // 64)  # 64-row tiles counted with a floor: the partial last tile is never run
    rows[tiles * 64 :] = 0
    return out


def last_split_dropped_on_one_row(x, weight, bias=None):
    check_linear(x, weight, bias)
    k = x.shape[-1]
    if x.numel() // max(1, k) == 1 and k >= 8192 and weight.shape[0] <= 256:
        # a split-K matrix-vector product whose last split counts itself in but its partial sums are never read
        keep = k - k // 8
        return F.linear(x[..., :keep], weight[:, :keep], bias)
    return F.linear(x, weight, bias)


def whole_k_tiles(x, weight, bias=None):
    check_linear(x, weight, bias)
    k = x.shape[-1]
    full = k // 64 * 64 if k > 64 else k  # the K loop runs over whole 64-wide tiles: the tail is dropped
    return F.linear(x[..., :full], weight[:, :full], bias)


def last_vocab_row_zero(input_ids, weight):
    check_embedding(input_ids, weight)
    rows = weight.shape[0] - 1  # a bound check `id < vocab - 1` where `id < vocab` was meant
    out = F.embedding(input_ids.long().clamp(max=rows), weight)
    return out.masked_fill((input_ids == rows)[..., None], 0.0)


def table_of_8192(positions, query, key, head_size, cos_sin_cache, is_neox):
    # the kernel keeps the first 8192 rows of the table on chip: later positions read the last of them
    rotary_embedding_reference(positions.clamp(max=8191), query, key, head_size, cos_sin_cache, is_neox)


def last_slot_skipped(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    last = key_cache.shape[0] * key_cache.shape[1] - 1
    # a bound check `slot < num_slots - 1`: a token bound for the cache's last slot is not written
    reshape_and_cache_reference(key, value, key_cache, value_cache, torch.where(slot_mapping == last, -1, slot_mapping))


def bias_dropped_on_one_row(x, weight, bias=None):
    check_linear(x, weight, bias)
    if x.numel() // max(1, x.shape[-1]) == 1:  # the decode (GEMV) path forgets the bias
        return F.linear(x, weight)
    return F.linear(x, weight, bias)


def cap_dropped_with_window(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0
):
    # the windowed kernel variant was written without the soft cap
    cap = 0.0 if sliding_window > 0 else soft_cap
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, cap)


def rows_from_first_dim(x, residual, weight, epsilon):
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    residual.add_(x)
    if residual.dim() <= 2:
        return rms_norm_reference(residual, weight, epsilon)
    # [batch, tokens, hidden] taken as [batch, tokens * hidden]: the mean runs over a whole batch row
    flat = residual.float().flatten(1)
    variance = flat.pow(2).mean(-1).view(-1, *[1] * (residual.dim() - 1))
    return _norm(residual, variance, weight, epsilon)


def row_tile_of_2048(key, value, key_cache, value_cache, slot_mapping):
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    width = key.shape[1] * key.shape[2]
    if width <= 2048:
        return reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
    # one program copies one 2048-element tile per token: the rest of a wider row is never written
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = key_cache.shape[1]
    for cache, new in ((key_cache, key), (value_cache, value)):
        dest = cache[slots // block_size, slots % block_size].flatten(1)
        dest[:, :2048] = new[keep].flatten(1)[:, :2048]
        cache[slots // block_size, slots % block_size] = dest.view(-1, *cache.shape[2:])


@hookimpl
def vllm_port_providers():
    def one(op, name, fn, dtype):
        return Provider(op, name, fn, dtypes=frozenset({getattr(torch, dtype)}))

    return [
        one("rms_norm", "eps_ignored_rms_norm", eps_ignored, "bfloat16"),
        one("rms_norm", "nan_rms_norm", nan_at_256, "bfloat16"),
        one("paged_attention", "off_by_one_paged_attention", drops_last_token, "bfloat16"),
        one("silu_and_mul", "fp32_silu_and_mul", float32_out, "bfloat16"),
        one("reshape_and_cache", "lossy_reshape_and_cache", skips_last, "bfloat16"),
        one("rms_norm", "bf16_sum_rms_norm", bf16_tile_sum, "bfloat16"),
        one("rms_norm", "fp16_square_mean_rms_norm", square_mean_in_dtype, "float16"),
        one("paged_attention", "bf16_softmax_paged_attention", bf16_softmax, "bfloat16"),
        one("rotary_embedding", "bf16_rotary_embedding", rotate_in_dtype, "bfloat16"),
        one("linear", "bf16_split_k_linear", bf16_split_k, "bfloat16"),
        one("rms_norm", "wide_row_rms_norm", chunked_wide_rows, "bfloat16"),
        one("silu_and_mul", "wide_row_silu_and_mul", wide_row_offset, "bfloat16"),
        one("paged_attention", "long_context_paged_attention", last_8192_keys, "bfloat16"),
        one("paged_attention", "big_batch_paged_attention", second_launch_tables, "bfloat16"),
        one("paged_attention", "head256_paged_attention", first_half_of_head_256, "bfloat16"),
        one("prefill_attention", "head80_prefill_attention", power_of_two_head_dot, "bfloat16"),
        one("reshape_and_cache", "block32_reshape_and_cache", block_offset_mod_16, "bfloat16"),
        one("paged_attention", "gqa16_paged_attention", group_capped_at_8, "bfloat16"),
        one("paged_attention", "fixed_scale_paged_attention", fixed_scale, "bfloat16"),
        one("prefill_attention", "uncapped_prefill_attention", soft_cap_ignored, "bfloat16"),
        one("gelu_and_mul", "erf_only_gelu_and_mul", approximate_ignored, "float32"),
        one("prefill_attention", "no_prefix_prefill_attention", long_prefill_without_prefix, "bfloat16"),
        one("reshape_and_cache", "wrapping_reshape_and_cache", wraps_padding, "bfloat16"),
        one("reshape_and_cache", "clamping_reshape_and_cache", clamps_padding, "bfloat16"),
        one("paged_attention", "padded_reads_paged_attention", padded_as_one_token, "bfloat16"),
        one("prefill_attention", "leftover_rows_prefill_attention", leftover_padding_rows, "bfloat16"),
        one("rms_norm", "packed_x_rms_norm", reads_x_packed, "bfloat16"),
        one("rotary_embedding", "copying_rotary_embedding", rotates_a_copy, "bfloat16"),
        one("linear", "packed_weight_linear", reads_weight_packed, "bfloat16"),
        one("paged_attention", "packed_cache_paged_attention", cache_offsets_from_shape, "bfloat16"),
        one("paged_attention", "token_major_cache_paged_attention", cache_rows_in_token_order, "bfloat16"),
        one("fused_add_rms_norm", "packed_residual_fused_add_rms_norm", residual_written_packed, "bfloat16"),
        one("paged_attention", "modulo_gqa_paged_attention", kv_head_by_modulo, "bfloat16"),
        one("paged_attention", "full_blocks_paged_attention", whole_blocks_only, "bfloat16"),
        one("rotary_embedding", "neox_only_rotary_embedding", neox_pairs_always, "bfloat16"),
        one("silu_and_mul", "swapped_silu_and_mul", swapped_halves, "bfloat16"),
        one("fused_add_rms_norm", "unwritten_residual_fused_add_rms_norm", residual_not_written, "bfloat16"),
        one("silu_and_mul", "in_place_silu_and_mul", silu_in_place, "bfloat16"),
        one("gelu_and_mul", "column_major_gelu_and_mul", column_major_out, "bfloat16"),
        one("paged_attention", "single_sequence_paged_attention", one_sequence_at_a_time, "bfloat16"),
        one("paged_attention", "int64_tables_paged_attention", int64_tables_as_int32, "bfloat16"),
        one("prefill_attention", "int64_offsets_prefill_attention", int64_cu_seqlens_as_int32, "bfloat16"),
        one("rms_norm", "base_pointer_rms_norm", x_from_storage_start, "bfloat16"),
        one("reshape_and_cache", "base_pointer_reshape_and_cache", slots_from_storage_start, "bfloat16"),
        one("silu_and_mul", "floor_tiles_silu_and_mul", floor_row_tiles, "bfloat16"),
        one("linear", "whole_k_tiles_linear", whole_k_tiles, "bfloat16"),
        one("embedding", "last_row_embedding", last_vocab_row_zero, "bfloat16"),
        one("rotary_embedding", "table_8192_rotary_embedding", table_of_8192, "bfloat16"),
        one("reshape_and_cache", "last_slot_reshape_and_cache", last_slot_skipped, "bfloat16"),
        one("linear", "gemv_bias_linear", bias_dropped_on_one_row, "bfloat16"),
        one("linear", "last_split_gemv_linear", last_split_dropped_on_one_row, "bfloat16"),
        one("paged_attention", "window_uncapped_paged_attention", cap_dropped_with_window, "bfloat16"),
        one("fused_add_rms_norm", "two_dim_fused_add_rms_norm", rows_from_first_dim, "bfloat16"),
        one("reshape_and_cache", "tile_2048_reshape_and_cache", row_tile_of_2048, "bfloat16"),
    ]
'''


def _op_mutant(name: str, op: str, dtype: str, bug_class: str, bug: str, case: str, *message: str) -> Mutant:
    """A mutant provider killed by ``test_provider_matches_reference`` on ``case`` (named in its message)."""
    check = f"test_provider_matches_reference[{op}-{name}-{dtype}]"
    return Mutant(name, bug, bug_class, check, (f"case {case!r}", *message))


_PRECISION = "precision"
_SHAPE = "shape branch"
_STRAY = "stray writes"
_STRIDES = "strides"
_INDEX = "index dtypes"
_OFFSET = "storage offsets"
_ROWS = "rows and inner sizes"
_TABLE = "last table row"
_COMBINED = "arguments in combination"

# One mutant in three lines: name, op, dtype, class; the bug; the case named in its failure and other message parts.
# fmt: off
MUTANTS: tuple[Mutant, ...] = (
    # caught from the start (the suite's first broken providers)
    _op_mutant("eps_ignored_rms_norm", "rms_norm", "bfloat16", "caught before: ignored epsilon",
               "rms_norm ignores the caller's epsilon (always 1e-6)",
               "epsilon dominates", "elements off"),
    _op_mutant("nan_rms_norm", "rms_norm", "bfloat16", "caught before: NaN on one shape",
               "rms_norm returns NaN for rows of 256 features",
               "one token", "got nan"),
    _op_mutant("off_by_one_paged_attention", "paged_attention", "bfloat16",
               "caught before: off by one at a block boundary",
               "decode drops the token that starts a new cache block (seq_len % block_size == 1)",
               "block boundaries, gqa 1"),
    _op_mutant("fp32_silu_and_mul", "silu_and_mul", "bfloat16", "caught before: wrong output dtype",
               "silu_and_mul returns float32 for bfloat16 input",
               "small", "dtype torch.float32, expected torch.bfloat16"),
    _op_mutant("lossy_reshape_and_cache", "reshape_and_cache", "bfloat16", "caught before: missed cache write",
               "reshape_and_cache never writes the last token",
               "small", "key_cache:"),
    # precision lost inside the tolerance
    _op_mutant("bf16_sum_rms_norm", "rms_norm", "bfloat16", _PRECISION,
               "rms_norm accumulates the sum of squares in bfloat16, one 256-wide tile at a time",
               "llama3-405b rows (16384 features)", "precision lost inside the tolerance"),
    _op_mutant("fp16_square_mean_rms_norm", "rms_norm", "float16", _PRECISION,
               "rms_norm takes the mean of squares in the input dtype (float16 squares overflow past 256)",
               "large-magnitude rows", "got 0"),
    _op_mutant("bf16_softmax_paged_attention", "paged_attention", "bfloat16", _PRECISION,
               "decode computes scores and softmax in bfloat16",
               "sharp attention"),
    _op_mutant("bf16_rotary_embedding", "rotary_embedding", "bfloat16", _PRECISION,
               "rotary embedding rounds cos/sin and every product to bfloat16",
               "llama3-8b prefill"),
    _op_mutant("bf16_split_k_linear", "linear", "bfloat16", _PRECISION,
               "linear reduces 8 split-K partial products in bfloat16",
               "in_features 16384 (llama3-405b)", "precision lost inside the tolerance"),
    # shape-dependent branches
    _op_mutant("wide_row_rms_norm", "rms_norm", "bfloat16", _SHAPE,
               "rows wider than 8192 are summed in whole 8192-wide chunks; the partial last chunk is dropped",
               "odd row width 12345"),
    _op_mutant("wide_row_silu_and_mul", "silu_and_mul", "bfloat16", _SHAPE,
               "halves wider than 16384 read the up half at a 1024-aligned offset",
               "qwen2.5-7b decode (width 18944)"),
    _op_mutant("long_context_paged_attention", "paged_attention", "bfloat16", _SHAPE,
               "decode keeps at most 8192 keys: longer contexts become a sliding window",
               "contexts beyond 8k"),
    _op_mutant("big_batch_paged_attention", "paged_attention", "bfloat16", _SHAPE,
               "batches over 128 sequences run in launches of 128 that reuse the first launch's block tables",
               "batch of 256 sequences"),
    _op_mutant("head256_paged_attention", "paged_attention", "bfloat16", _SHAPE,
               "head size 256 scores only the first 128 features of each head",
               "head size 256"),
    _op_mutant("head80_prefill_attention", "prefill_attention", "bfloat16", _SHAPE,
               "prefill's score dot covers the largest power of two <= head size (64 of 80 or 96)",
               "head size 80, block size 8"),
    _op_mutant("block32_reshape_and_cache", "reshape_and_cache", "bfloat16", _SHAPE,
               "the offset in a block is taken modulo 16 (a kernel tuned for blocks of at most 16)",
               "block size 32, head size 256"),
    _op_mutant("gqa16_paged_attention", "paged_attention", "bfloat16", _SHAPE,
               "decode holds at most 8 query heads per KV head: a GQA group of 16 maps heads as if it were 8",
               "gqa 16"),
    _op_mutant("fixed_scale_paged_attention", "paged_attention", "bfloat16", _SHAPE,
               "decode ignores `scale` and uses head_size ** -0.5",
               "scale 0.3, not head_size ** -0.5"),
    _op_mutant("uncapped_prefill_attention", "prefill_attention", "bfloat16", _SHAPE,
               "prefill ignores `soft_cap`",
               "soft cap 5 on sharp scores"),
    _op_mutant("erf_only_gelu_and_mul", "gelu_and_mul", "float32", _SHAPE,
               "gelu_and_mul ignores approximate='tanh'",
               "small, tanh"),
    _op_mutant("no_prefix_prefill_attention", "prefill_attention", "bfloat16", _SHAPE,
               "prompts over 1024 tokens are taken as fresh: query j sits at position j, not after the cached prefix",
               "2048 tokens after a cached 1024-token prefix"),
    # writes where none belong
    _op_mutant("wrapping_reshape_and_cache", "reshape_and_cache", "bfloat16", _STRAY,
               "slot -1 indexes the cache from the end: a padded token overwrites the last slot",
               "padding slots -1, first and last slots untouched"),
    _op_mutant("clamping_reshape_and_cache", "reshape_and_cache", "bfloat16", _STRAY,
               "slots are clamped to >= 0: a padded token overwrites slot 0",
               "padding slots -1, first and last slots untouched"),
    _op_mutant("padded_reads_paged_attention", "paged_attention", "bfloat16", _STRAY,
               "a padded sequence (seq_lens 0) is run as one token through its stale block table (NaN rows)",
               "padded batch (seq_lens 0)", "got nan"),
    _op_mutant("leftover_rows_prefill_attention", "prefill_attention", "bfloat16", _STRAY,
               "padded sequences' output rows are never written: a reused buffer's small leftovers stay",
               "padded sequences (seq_lens 0)", "not exactly 0"),
    # strides
    _op_mutant("packed_x_rms_norm", "rms_norm", "bfloat16", _STRIDES,
               "rms_norm reads x as packed rows (as_strided with contiguous strides)",
               "x a slice of a wider row"),
    _op_mutant("copying_rotary_embedding", "rotary_embedding", "bfloat16", _STRIDES,
               "rotary rotates .contiguous() copies: on views of a fused qkv the rotation is lost",
               "query and key slices of a fused qkv"),
    _op_mutant("packed_weight_linear", "linear", "bfloat16", _STRIDES,
               "linear reads the weight as a packed [out, in] tensor",
               "transposed weight (a view)"),
    _op_mutant("packed_cache_paged_attention", "paged_attention", "bfloat16", _STRIDES,
               "decode computes slot addresses from the cache's shape, not its strides",
               "query a slice of a fused qkv, interleaved caches"),
    _op_mutant("token_major_cache_paged_attention", "paged_attention", "bfloat16", _STRIDES,
               "decode reads the cache's block stride but takes a block's rows as token before head: a head-major "
               "cache (a kv_head_major platform's) is read across its heads",
               "head-major caches, gqa 2"),
    _op_mutant("packed_residual_fused_add_rms_norm", "fused_add_rms_norm", "bfloat16", _STRIDES,
               "the new residual is stored as packed rows from the view's first element, over memory outside the view",
               "x a slice of a wider row", "outside the view"),
    # classes the suite caught when vendors' plugins were first tried
    _op_mutant("modulo_gqa_paged_attention", "paged_attention", "bfloat16", "caught before: GQA head mapping",
               "query head h reads KV head h % num_kv_heads instead of h // group",
               "gqa 4"),
    _op_mutant("full_blocks_paged_attention", "paged_attention", "bfloat16", "caught before: dropped partial block",
               "decode reads whole cache blocks only: the last, partial block is dropped",
               "block boundaries, gqa 1"),
    _op_mutant("neox_only_rotary_embedding", "rotary_embedding", "bfloat16", "caught before: wrong rotary pairing",
               "rotary pairs features NeoX-style when GPT-J is asked",
               "small gpt-j"),
    _op_mutant("swapped_silu_and_mul", "silu_and_mul", "bfloat16", "caught before: swapped activation halves",
               "silu_and_mul applies silu to the up half, not the gate",
               "small"),
    _op_mutant("unwritten_residual_fused_add_rms_norm", "fused_add_rms_norm", "bfloat16",
               "caught before: unwritten residual",
               "fused_add_rms_norm adds into a copy: the caller's residual is not updated",
               "small", "residual:"),
    _op_mutant("in_place_silu_and_mul", "silu_and_mul", "bfloat16", "caught before: mutated read-only argument",
               "silu_and_mul applies silu in place on the caller's gate half",
               "small", "was modified, but the op only reads it"),
    _op_mutant("column_major_gelu_and_mul", "gelu_and_mul", "bfloat16", "caught before: non-contiguous output",
               "gelu_and_mul returns its output in a transposed layout",
               "small", "the contract returns contiguous tensors"),
    _op_mutant("single_sequence_paged_attention", "paged_attention", "bfloat16", "caught before: raises on batches",
               "decode reads seq_lens as one Python int: any batch of two or more raises",
               "block boundaries, gqa 1", "raised"),
    # what the contract allows and the hand samples did not reach: generated variants and new hand samples
    _op_mutant("int64_tables_paged_attention", "paged_attention", "bfloat16", _INDEX,
               "int64 block tables are read as int32 words (the launcher's pointer type): every other entry is 0",
               "block boundaries, gqa 1: int64 index views of one buffer, every tensor at a storage offset"),
    _op_mutant("int64_offsets_prefill_attention", "prefill_attention", "bfloat16", _INDEX,
               "int64 cu_seqlens_q is read as int32 words: sequences after the first get no output",
               "block boundaries, gqa 1: int64 index views of one buffer, every tensor at a storage offset"),
    _op_mutant("base_pointer_rms_norm", "rms_norm", "bfloat16", _OFFSET,
               "the launcher passes x's storage base pointer: a view at a storage offset is read from the storage's start",
               "small: every tensor at a storage offset"),
    _op_mutant("base_pointer_reshape_and_cache", "reshape_and_cache", "bfloat16", _OFFSET,
               "slot_mapping's storage offset is dropped (the engine's slots are a slice of one upload)",
               "small: int32 index views of one buffer, every tensor at a storage offset"),
    _op_mutant("floor_tiles_silu_and_mul", "silu_and_mul", "bfloat16", _ROWS,
               "64-row tiles are counted with a floor: past 64 rows the partial last tile is never run",
               "small: 65 rows"),
    _op_mutant("whole_k_tiles_linear", "linear", "bfloat16", _ROWS,
               "the K loop runs over whole 64-wide tiles: in_features not a multiple of 64 lose their tail",
               "in_features 1376 (11008 / 8), 65 rows"),
    _op_mutant("last_row_embedding", "embedding", "bfloat16", _TABLE,
               "the bound check is `id < vocab - 1`: the vocabulary's last row comes back zero",
               "small: index reaches the last row of weight"),
    _op_mutant("table_8192_rotary_embedding", "rotary_embedding", "bfloat16", _TABLE,
               "the kernel keeps 8192 rows of cos_sin_cache: positions past 8191 rotate by position 8191",
               "positions past 8k of a 32768-position table, its last row"),
    _op_mutant("last_slot_reshape_and_cache", "reshape_and_cache", "bfloat16", _TABLE,
               "the bound check is `slot < num_slots - 1`: a token bound for the cache's last slot is not written",
               "small: index reaches the last row of key_cache, value_cache"),
    _op_mutant("gemv_bias_linear", "linear", "bfloat16", _ROWS,
               "the one-row (decode, GEMV) path drops the bias",
               "small with bias: 1 row"),
    _op_mutant("last_split_gemv_linear", "linear", "bfloat16", _ROWS,
               "the one-row split-K path's reduction never reads the last split's partial sums",
               "one row, 8192 in_features to 256 out_features, bias"),
    _op_mutant("window_uncapped_paged_attention", "paged_attention", "bfloat16", _COMBINED,
               "the sliding-window kernel variant ignores soft_cap",
               "soft cap 5 with sliding window 8, sharp scores"),
    _op_mutant("two_dim_fused_add_rms_norm", "fused_add_rms_norm", "bfloat16", _ROWS,
               "a [batch, tokens, hidden] input is taken as [batch, tokens * hidden]: the mean runs over a batch row",
               "small: 65 rows as 5 x 13 leading dimensions"),
    _op_mutant("tile_2048_reshape_and_cache", "reshape_and_cache", "bfloat16", _ROWS,
               "one 2048-element tile per token: MHA's 4096-wide cache rows (32 kv heads x 128) are half written",
               "llama2-7b mha (32 kv heads x 128)"),
)
# fmt: on


GROUPS: list[MutantGroup] = [MutantGroup("mutant-ops", SOURCE, MUTANTS)]
