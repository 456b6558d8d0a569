"""Blind one-bug vendor plugins for issue 25, written without reading the conformance suite.

Each plugin is a platform plugin on the host CPU (device type ``cpu``) whose source is held here as a
string; each bug is one a real kernel or comm/memory part could have, wrong only on inputs the
contract allows (shapes, dtypes, views and argument combinations the engine or a real model passes)
and right on the common ones. The op bugs share one plugin, ``blind-ops``: one provider per bug, each
with its own name and registered for the one dtype its bug is shown in; every comm or memory bug is a
plugin of its own, since those parts are replaced whole. ``blind_demos.py`` shows every bug (op bugs
and memory bugs in this process, comm bugs on two gloo ranks) on one small input against the reference.

To certify one: write ``source`` as ``<module>.py`` with a ``<module>-0.0.1.dist-info`` folder (METADATA
and an entry_points.txt naming ``[vllm_port] <name> = <module>``) into a directory on ``PYTHONPATH``,
then ``vllm-port certify <name>`` (:func:`install` does the writing).
"""

# Today's suite on these plugins (for information; recorded by `vllm-port certify <name>` on
# 2026-12-01, before issue 25's suite changes were merged):
#
# | plugin | part | class | verdict |
# | --- | --- | --- | --- |
# | blind-ops | blind_embedding_last_row (embedding) | last row of an indexed table | certified (escapes) |
# | blind-ops | blind_embedding_shard_offset (embedding) | view at a non-zero storage offset | certified (escapes) |
# | blind-ops | blind_rms_norm_tail_tile (rms_norm) | inner size not a multiple of the tile | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_rms_norm_view_offset (rms_norm) | view at a non-zero storage offset | certified (escapes) |
# | blind-ops | blind_fused_add_persistent_rows (fused_add_rms_norm) | row count past a tile boundary (more than 64 rows) | certified (escapes) |
# | blind-ops | blind_fused_add_decode_row (fused_add_rms_norm) | one-row (decode) input | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_rotary_table_ring (rotary_embedding) | rotary positions past 8k | certified (escapes) |
# | blind-ops | blind_rotary_last_row (rotary_embedding) | rotary positions: the table's last row | certified (escapes) |
# | blind-ops | blind_rotary_3d_heads (rotary_embedding) | 3-D input where the contract allows it | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_rotary_positions_offset (rotary_embedding) | index tensors the engine passes (offset slices of one upload) | certified (escapes) |
# | blind-ops | blind_silu_leading_dims (silu_and_mul) | 3-D input where the contract allows it | certified (escapes) |
# | blind-ops | blind_gelu_tail_tile (gelu_and_mul) | inner size not a multiple of 64 | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_linear_gemv_bias (linear) | one-row (decode) input | certified (escapes) |
# | blind-ops | blind_linear_k_tail (linear) | inner size not a multiple of the tile | certified (escapes) |
# | blind-ops | blind_linear_a_offset (linear) | view at a non-zero storage offset | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_cache_int32_slots (reshape_and_cache) | int32 vs int64 metadata (slot_mapping) | certified (escapes) |
# | blind-ops | blind_cache_row_block (reshape_and_cache) | 4096-wide MHA cache rows | certified (escapes) |
# | blind-ops | blind_cache_slots_offset (reshape_and_cache) | index tensors the engine passes (offset slices of one upload) | certified (escapes) |
# | blind-ops | blind_decode_int64_tables (paged_attention) | int32 vs int64 metadata (block_tables) | certified (escapes) |
# | blind-ops | blind_decode_cap_after_window (paged_attention) | arguments in combination (soft cap with sliding window) | certified (escapes) |
# | blind-ops | blind_decode_null_last_block (paged_attention) | last row of an indexed table (the last cache block) | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_decode_value_offset (paged_attention) | view at a non-zero storage offset | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_decode_split_kv (paged_attention) | one-row (decode) input: a batch of one sequence | certified (escapes) |
# | blind-ops | blind_prefill_int64_lens (prefill_attention) | int32 vs int64 metadata (seq_lens) | certified (escapes) |
# | blind-ops | blind_prefill_cap_drops_window (prefill_attention) | arguments in combination (soft cap with sliding window) | certified (escapes) |
# | blind-ops | blind_prefill_tile_causal (prefill_attention) | token count past a tile boundary (more than 64 query rows) | refused: test_ops::test_provider_matches_reference |
# | blind-ops | blind_sample_top_k_minus_one (sample) | engine defaults (top_k = -1) | certified (escapes) |
# | blind-ops | blind_sample_top_p_one_skips (sample) | engine defaults (top_p = 1.0) | refused: test_ops::test_provider_matches_reference, test_sampling::test_sampler_equivalence |
# | blind-ops | blind_sample_seeds_offset (sample) | index tensors the engine passes (offset slices of one upload) | certified (escapes) |
# | blind-ops | blind_sample_int32_top_k (sample) | int32 vs int64 metadata (top_k) | refused: test_ops::test_provider_matches_reference, test_sampling::test_sampler_equivalence |
# | blind-comm-int64 | communicator (all_reduce) | comm: int64 all_reduce above 2^24 | certified (escapes) |
# | blind-comm-64k | communicator (all_reduce) | comm: messages past 64 KiB | certified (escapes) |
# | blind-comm-odd | communicator (all_gather) | comm: an odd element count | certified (escapes) |
# | blind-migrator-ring | migrator (copy_blocks) | memory: swaps of more than 64 blocks | certified (escapes) |
# | blind-migrator-last | migrator (copy_blocks) | memory: the last block of a pool | not certified: test_memory::test_swap_between_kv_caches_of_every_tier_is_bit_exact |
# | blind-allocator-arena | allocator (allocate) | memory: an allocator off on large sizes | certified (escapes) |
#
# In all: 10 of 30 op bugs and 1 of 6 comm/memory bugs refused today.

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["BLIND", "BlindBug", "BlindPlugin", "install"]


@dataclass(frozen=True)
class BlindBug:
    """One planted bug: which part carries it, in which op or contract, what it is and its class."""

    part: str  # provider name, or "allocator" / "migrator" / "communicator"
    op_or_contract: str
    bug: str  # one line
    bug_class: str


@dataclass(frozen=True)
class BlindPlugin:
    """One installable plugin: its entry-point name, its module's full source and the bugs it carries."""

    name: str  # entry-point name, unique, e.g. "blind-ops"
    source: str  # the plugin module's full source
    bugs: tuple[BlindBug, ...]

    @property
    def module(self) -> str:
        """The module name the source is installed as."""
        return "vllm_port_" + self.name.replace("-", "_")


def install(plugin: BlindPlugin, site: Path) -> Path:
    """Write ``plugin`` into ``site`` as an installed distribution (module and dist-info); return ``site``."""
    dist = site / f"{plugin.module}-0.0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (site / f"{plugin.module}.py").write_text(plugin.source, encoding="utf-8")
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {plugin.module.replace('_', '-')}\nVersion: 0.0.1\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(f"[vllm_port]\n{plugin.name} = {plugin.module}\n", encoding="utf-8")
    return site


BLIND_OPS_SOURCE = r'''"""A vendor's platform plugin ("blind-ops") whose op providers each carry one planted kernel bug.

Every provider first runs its op's input check, then emulates its kernel in torch: launch-time
decisions (tile sizes, fast paths, index-dtype instantiations, base pointers) are written out the
way the kernel makes them, and each provider gets exactly one of them wrong. Each is registered for
one dtype and is right on the shapes of common models; the bug shows only on inputs the contract
allows past those shapes.
"""

from __future__ import annotations

import os
import platform as _host

import torch
import torch.nn.functional as F

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider, provider
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
    check_sample,
    check_silu_and_mul,
)
from vllm_port.ops.sampling import filled_truncation, gumbel_noise

NAME = "blind-ops"
F32, BF16, F16 = (torch.float32,), (torch.bfloat16,), (torch.float16,)
PRIORITY = 50


# -------------------------------------------------------------------------------------------------
# Platform
# -------------------------------------------------------------------------------------------------


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-ops emulator)", arch=_host.machine())
    return ProbeResult(True, f"blind-ops emulates its kernels on the host CPU ({os.cpu_count()} cores)", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return list(PROVIDERS)


# -------------------------------------------------------------------------------------------------
# Kernel building blocks (correct)
# -------------------------------------------------------------------------------------------------


def _compute(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _from_storage_start(t: torch.Tensor) -> torch.Tensor:
    """What a kernel reads when it takes the storage's base pointer with the view's sizes and strides."""
    return t.as_strided(t.shape, t.stride(), 0)


def _int32_words_as_int64(t: torch.Tensor) -> torch.Tensor:
    """An int32 index tensor as a kernel built for int64 reads it: element i is words 2i, 2i+1.

    Words past the tensor's end read as -1 here (on a device they are whatever memory follows).
    """
    words = t.contiguous().view(-1).to(torch.int64)
    n = words.shape[0]
    lo = words[0::2]
    hi = torch.cat([words[1::2], words.new_zeros(lo.shape[0] - words[1::2].shape[0])])
    merged = (lo & 0xFFFFFFFF) | (hi << 32)
    out = torch.full((n,), -1, dtype=torch.int64, device=t.device)
    out[: merged.shape[0]] = merged
    return out.view(t.shape)


def _int64_as_int32_words(t: torch.Tensor) -> torch.Tensor:
    """An int64 index tensor as a kernel built for int32 reads it: element i is 32-bit word i."""
    flat = t.contiguous().view(-1).view(torch.int32)[: t.numel()]
    return flat.to(torch.int64).view(t.shape)


def _rms(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    xc = x.to(_compute(x.dtype))
    variance = xc.pow(2).mean(dim=-1, keepdim=True)
    return ((xc * torch.rsqrt(variance + epsilon)).to(x.dtype) * weight).contiguous()


def _rotate(positions, query, key, head_size, cos_sin_cache, is_neox, heads_of=None) -> None:
    """Rotate query and key in place by the table rows of ``positions`` (int64 tensor)."""
    rot = cos_sin_cache.shape[-1]
    compute = _compute(query.dtype)
    cos, sin = cos_sin_cache[positions].to(compute).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for t in (query, key):
        heads = (heads_of or _heads)(t, head_size)
        x = heads[..., :rot].to(compute)
        x1, x2 = (x[..., : rot // 2], x[..., rot // 2 :]) if is_neox else (x[..., 0::2], x[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
        heads[..., :rot] = rotated.to(t.dtype)


def _heads(t: torch.Tensor, head_size: int) -> torch.Tensor:
    return t.unflatten(-1, (-1, head_size)) if t.dim() == 2 else t


def _gather(cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):
    """Each sequence's cached tokens, padded: ``[seqs, longest, kv_heads, dim]``, their blocks, and the real mask."""
    block_size = cache.shape[1]
    longest = int(lens.max()) if lens.numel() else 0
    pos = torch.arange(longest, device=cache.device)
    real = pos[None, :] < lens[:, None]
    blocks = torch.where(real, tables[:, pos // block_size], 0)
    tokens = cache[blocks, pos % block_size]
    return tokens.masked_fill(~real[..., None, None], 0.0), blocks, real


def _attention(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    soft_cap: float,
    *,
    hide=None,
    cap_after_window: bool = False,
) -> torch.Tensor:
    """``q`` ``[seqs, q_len, heads, dim]`` at ``q_pos`` ``[seqs, q_len]`` over the paged cache, in float32.

    ``hide(blocks, positions) -> mask`` removes more keys (a kernel's own skip rule);
    ``cap_after_window`` soft-caps scores after the window's mask was written into them.
    """
    compute = _compute(q.dtype)
    k, blocks, real = _gather(key_cache, tables, lens)
    v, _, _ = _gather(value_cache, tables, lens)
    kv_heads = k.shape[2]
    qc = q.to(compute).unflatten(2, (kv_heads, -1))
    scores = torch.einsum("sqngd,sknd->sngqk", qc, k.to(compute)) * scale
    k_pos = torch.arange(k.shape[1], device=q.device)
    seen = real[:, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None])
    window = torch.ones_like(seen)
    if sliding_window > 0:
        window = k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    if hide is not None:
        seen &= ~hide(blocks, k_pos)[:, None, :]
    if cap_after_window:
        scores = scores.masked_fill(~window[:, None, None], float("-inf"))
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
    else:
        if soft_cap > 0:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        seen &= window
    seen = seen[:, None, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    probs = torch.where(seen.any(dim=-1, keepdim=True), probs, 0.0).to(q.dtype).to(compute)
    out = torch.einsum("sngqk,sknd->sqngd", probs, v.to(compute))
    return out.flatten(2, 3).to(q.dtype)


def _decode(query, key_cache, value_cache, tables, lens, scale, sliding_window, soft_cap, **bug) -> torch.Tensor:
    tables, lens = tables.long(), lens.long()
    q_pos = (lens - 1)[:, None]
    out = _attention(
        query[:, None], q_pos, key_cache, value_cache, tables, lens, scale, sliding_window, soft_cap, **bug
    )
    return out[:, 0].contiguous()


def _prefill(
    query, key_cache, value_cache, tables, cu_seqlens_q, lens, scale, sliding_window, soft_cap, row_pos=None
) -> torch.Tensor:
    """Packed prefill; ``row_pos(j)`` is the kernel's offset of query row ``j`` within its sequence."""
    starts, lens, tables = cu_seqlens_q.long(), lens.long(), tables.long()
    q_lens = starts[1:] - starts[:-1]
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=query.device), q_lens)
    row = torch.arange(seq.shape[0], device=query.device) - starts[seq]
    longest = int(q_lens.max()) if q_lens.numel() else 0
    q = query.new_zeros((lens.shape[0], longest, *query.shape[1:]))
    q[seq, row] = query[: seq.shape[0]]
    j = torch.arange(longest, device=query.device)[None, :]
    offset = j if row_pos is None else row_pos(j)
    q_pos = torch.where((j < q_lens[:, None]) & (lens[:, None] > 0), lens[:, None] - q_lens[:, None] + offset, -1)
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    out[: seq.shape[0]] = _attention(q, q_pos, key_cache, value_cache, tables, lens, scale, sliding_window, soft_cap)[
        seq, row
    ]
    return out


def _write_cache(key, value, key_cache, value_cache, slots: torch.Tensor, row_limit: int | None = None) -> None:
    """Write token t's key and value to ``slots[t]``; slots outside the caches are skipped (the kernel's guard)."""
    num_blocks, block_size, kv_heads, head_size = key_cache.shape
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    s = slots[keep]
    blk, off = s // block_size, s % block_size
    for src, cache in ((key, key_cache), (value, value_cache)):
        rows = src[keep]
        if row_limit is not None:  # elements of a token's row past the program's block stay unwritten
            inside = (torch.arange(kv_heads * head_size, device=src.device) < row_limit).view(kv_heads, head_size)
            rows = torch.where(inside, rows, cache[blk, off])
        cache[blk, off] = rows


def _sample(logits, temperature, top_k, top_p, seeds, *, k_of=None, filtered_rows=None) -> torch.Tensor:
    """The Gumbel-max sampler; ``k_of(top_k, vocab)`` and ``filtered_rows(top_p)`` are the kernel's own rules."""
    vocab = logits.shape[1]
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)  # None: no row truncates by it
    sampled = temperature > 0
    scores = logits.float() / torch.where(sampled, temperature, 1.0)[:, None]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = k_of(top_k, vocab) if k_of is not None else torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)
    drop = rank >= k[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    if filtered_rows is not None:
        drop &= filtered_rows(top_p)[:, None]
    dropped = torch.empty_like(drop).scatter_(1, order, drop)
    noisy = scores.masked_fill(dropped, float("-inf")) + gumbel_noise(seeds, vocab)
    return torch.where(sampled, noisy.argmax(dim=-1), logits.argmax(dim=-1))


# -------------------------------------------------------------------------------------------------
# embedding
# -------------------------------------------------------------------------------------------------


@provider("embedding", name="blind_embedding_last_row", priority=PRIORITY, dtypes=F32)
def embedding_last_row(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_embedding(input_ids, weight)
    ids = input_ids.long()
    # BUG: the gather's bound is written `id < vocab_size - 1`: the last vocabulary row reads as zeros
    inside = ids < weight.shape[0] - 1
    rows = weight[torch.where(inside, ids, 0)]
    return rows.masked_fill(~inside[..., None], 0.0).contiguous()


@provider("embedding", name="blind_embedding_shard_offset", priority=PRIORITY, dtypes=BF16)
def embedding_shard_offset(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_embedding(input_ids, weight)
    # BUG: the table's base pointer is its storage's, so a vocabulary shard table[start:end] reads from row 0
    table = _from_storage_start(weight)
    return table[input_ids.long()].contiguous()


# -------------------------------------------------------------------------------------------------
# rms_norm, fused_add_rms_norm
# -------------------------------------------------------------------------------------------------

NORM_BLOCK = 256


@provider("rms_norm", name="blind_rms_norm_tail_tile", priority=PRIORITY, dtypes=F32)
def rms_norm_tail_tile(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_rms_norm(x, weight, epsilon)
    hidden = x.shape[-1]
    if hidden <= NORM_BLOCK:  # one masked tile holds the row
        return _rms(x, weight, epsilon)
    # looped variant: whole tiles of NORM_BLOCK, unmasked (every Llama hidden size divides by 256)
    # BUG: a width that does not (5504 = 11008 / 2, 896) leaves its tail out of the sum of squares
    xc = x.to(_compute(x.dtype))
    covered = hidden // NORM_BLOCK * NORM_BLOCK
    variance = xc[..., :covered].pow(2).sum(dim=-1, keepdim=True) / hidden
    return ((xc * torch.rsqrt(variance + epsilon)).to(x.dtype) * weight).contiguous()


@provider("rms_norm", name="blind_rms_norm_view_offset", priority=PRIORITY, dtypes=BF16)
def rms_norm_view_offset(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_rms_norm(x, weight, epsilon)
    # BUG: rows are addressed from x's storage, not from the view: a view at a non-zero offset reads the wrong rows
    return _rms(_from_storage_start(x), weight, epsilon)


PERSISTENT_PROGRAMS = 64


@provider("fused_add_rms_norm", name="blind_fused_add_persistent_rows", priority=PRIORITY, dtypes=F32)
def fused_add_persistent_rows(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> torch.Tensor:
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    total = residual + x  # rounded to residual's dtype, in registers
    out = _rms(total, weight, epsilon)
    # a persistent grid of 64 programs: program p handles rows p, p + 64, p + 128, ...
    # BUG: the residual store is indexed by the program id, not by the row: past 64 rows,
    # row p keeps the last sum its program made and rows 64.. keep their old residual
    flat_total = total.reshape(-1, total.shape[-1])
    stored = residual.reshape(-1, residual.shape[-1]).clone()
    rows = flat_total.shape[0]
    programs = torch.arange(min(rows, PERSISTENT_PROGRAMS), device=x.device)
    last_row = programs + (rows - 1 - programs) // PERSISTENT_PROGRAMS * PERSISTENT_PROGRAMS
    stored[programs] = flat_total[last_row]
    residual.copy_(stored.view(residual.shape))
    return out


@provider("fused_add_rms_norm", name="blind_fused_add_decode_row", priority=PRIORITY, dtypes=F16)
def fused_add_decode_row(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    total = residual + x
    rows = x.numel() // max(x.shape[-1], 1)
    if rows != 1:
        residual.copy_(total)
    # BUG: the one-row latency path (a decode step of one sequence) never stores the residual back
    return _rms(total, weight, epsilon)


# -------------------------------------------------------------------------------------------------
# rotary_embedding
# -------------------------------------------------------------------------------------------------

ROPE_RING = 8192


@provider("rotary_embedding", name="blind_rotary_table_ring", priority=PRIORITY, dtypes=F32)
def rotary_table_ring(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    # BUG: the cos/sin rows are staged in a ring of 8192 entries, indexed `pos & 8191`: positions past 8k wrap
    _rotate(positions.long() & (ROPE_RING - 1), query, key, head_size, cos_sin_cache, is_neox)


@provider("rotary_embedding", name="blind_rotary_last_row", priority=PRIORITY, dtypes=F32)
def rotary_last_row(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    # BUG: the guard clamps to `max_position - 2` (the bound written as `< max_position - 1`): the last row is never read
    _rotate(
        positions.long().clamp(max=max(cos_sin_cache.shape[0] - 2, 0)), query, key, head_size, cos_sin_cache, is_neox
    )


def _heads_from_width(t: torch.Tensor, head_size: int) -> torch.Tensor:
    # BUG: heads counted as `size(-1) // head_size`, right for [tokens, heads * head_size] only:
    # a 3-D [tokens, heads, head_size] input counts one head, and only head 0 is rotated
    num_heads = t.shape[-1] // head_size
    return t.unflatten(-1, (num_heads, head_size)) if t.dim() == 2 else t[:, :num_heads]


@provider("rotary_embedding", name="blind_rotary_3d_heads", priority=PRIORITY, dtypes=BF16)
def rotary_3d_heads(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    _rotate(positions.long(), query, key, head_size, cos_sin_cache, is_neox, heads_of=_heads_from_width)


@provider("rotary_embedding", name="blind_rotary_positions_offset", priority=PRIORITY, dtypes=F16)
def rotary_positions_offset(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    # BUG: positions read from their storage's start: the engine's positions are a slice of one int64
    # upload (after the token ids), so the kernel rotates by the ids' rows (clamped by its bounds guard)
    read = _from_storage_start(positions).long().clamp(0, cos_sin_cache.shape[0] - 1)
    _rotate(read, query, key, head_size, cos_sin_cache, is_neox)


# -------------------------------------------------------------------------------------------------
# silu_and_mul, gelu_and_mul
# -------------------------------------------------------------------------------------------------


@provider("silu_and_mul", name="blind_silu_leading_dims", priority=PRIORITY, dtypes=F32)
def silu_leading_dims(x: torch.Tensor) -> torch.Tensor:
    d = check_silu_and_mul(x)
    # BUG: the launcher takes num_tokens = x.size(0) and width = numel / num_tokens: a 3-D
    # [batch, tokens, 2d] input is split into halves of tokens * 2d, not per token
    rows = x.shape[0] if x.dim() > 1 else 1
    flat = x.reshape(rows, -1)
    half = flat.shape[1] // 2
    out = F.silu(flat[:, :half]) * flat[:, half:]
    return out.reshape(*x.shape[:-1], d).contiguous()


GATED_BLOCK = 64


@provider("gelu_and_mul", name="blind_gelu_tail_tile", priority=PRIORITY, dtypes=F16)
def gelu_tail_tile(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    d = check_gelu_and_mul(x, approximate)
    out = F.gelu(x[..., :d], approximate=approximate) * x[..., d:]
    # BUG: past one tile the store mask is `col < d // 64 * 64`: a width that is not a multiple of 64
    # (1376 = 11008 / 8) leaves its last partial tile unwritten (zeros here; garbage on a device)
    if d > GATED_BLOCK:
        out[..., d // GATED_BLOCK * GATED_BLOCK :] = 0
    return out.contiguous()


# -------------------------------------------------------------------------------------------------
# linear
# -------------------------------------------------------------------------------------------------

K_BLOCK = 256


@provider("linear", name="blind_linear_gemv_bias", priority=PRIORITY, dtypes=F32)
def linear_gemv_bias(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    if rows == 1:
        # BUG: the one-row GEMV path (decode of one sequence) drops the bias
        return F.linear(x, weight).contiguous()
    return F.linear(x, weight, bias).contiguous()


@provider("linear", name="blind_linear_k_tail", priority=PRIORITY, dtypes=BF16)
def linear_k_tail(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, bias)
    k = x.shape[-1]
    if k <= K_BLOCK:
        return F.linear(x, weight, bias).contiguous()
    # BUG: the K loop runs over whole 256-wide tiles (4096, 11008, 14336 divide by 256): an in_features
    # that does not (5504 = 11008 / 2, a TP-2 shard of down_proj) drops its last partial tile
    covered = k // K_BLOCK * K_BLOCK
    return F.linear(x[..., :covered], weight[:, :covered], bias).contiguous()


@provider("linear", name="blind_linear_a_offset", priority=PRIORITY, dtypes=F16)
def linear_a_offset(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear(x, weight, bias)
    # BUG: the A operand's descriptor is built from x's storage pointer: a view at a non-zero offset reads other rows
    return F.linear(_from_storage_start(x), weight, bias).contiguous()


# -------------------------------------------------------------------------------------------------
# reshape_and_cache
# -------------------------------------------------------------------------------------------------

ROW_BLOCK = 2048


@provider("reshape_and_cache", name="blind_cache_int32_slots", priority=PRIORITY, dtypes=F32)
def cache_int32_slots(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # BUG: one instantiation, for the int64 slots the engine passes: int32 slots are read as int64 words,
    # and the slots this makes fall outside the cache, so the bounds guard drops them
    slots = _int32_words_as_int64(slot_mapping) if slot_mapping.dtype == torch.int32 else slot_mapping
    _write_cache(key, value, key_cache, value_cache, slots)


@provider("reshape_and_cache", name="blind_cache_row_block", priority=PRIORITY, dtypes=BF16)
def cache_row_block(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # BUG: one program per token with BLOCK = min(next_pow2(kv_heads * head_size), 2048): an MHA row of
    # 32 x 128 = 4096 elements is written up to element 2048 only
    _write_cache(key, value, key_cache, value_cache, slot_mapping.long(), row_limit=ROW_BLOCK)


@provider("reshape_and_cache", name="blind_cache_slots_offset", priority=PRIORITY, dtypes=F16)
def cache_slots_offset(key, value, key_cache, value_cache, slot_mapping) -> None:
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    # BUG: slot_mapping read from its storage's start: the engine's slots are a slice of one int64 upload
    # (after the ids and positions), so the kernel writes the tokens to the slots the ids name
    _write_cache(key, value, key_cache, value_cache, _from_storage_start(slot_mapping).long())


# -------------------------------------------------------------------------------------------------
# paged_attention
# -------------------------------------------------------------------------------------------------

PARTITION = 512


@provider("paged_attention", name="blind_decode_int64_tables", priority=PRIORITY, dtypes=F32)
def decode_int64_tables(
    query, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # BUG: one instantiation, for the int32 tables the engine passes: int64 block_tables are read as 32-bit words
    tables = _int64_as_int32_words(block_tables) if block_tables.dtype == torch.int64 else block_tables
    return _decode(query, key_cache, value_cache, tables, seq_lens, scale, sliding_window, soft_cap)


@provider("paged_attention", name="blind_decode_cap_after_window", priority=PRIORITY, dtypes=BF16)
def decode_cap_after_window(
    query, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # BUG: the window writes -inf into the scores before the soft cap: tanh(-inf) caps them to -soft_cap,
    # so with both a window and a cap the keys outside the window keep a weight
    return _decode(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, cap_after_window=True
    )


@provider("paged_attention", name="blind_decode_null_last_block", priority=PRIORITY, dtypes=F32)
def decode_null_last_block(
    query, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    last = key_cache.shape[0] - 1
    # BUG: ported from an engine that reserves the pool's last block as its null block: keys there are skipped
    return _decode(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap,
        hide=lambda blocks, _pos: blocks == last,
    )  # fmt: skip


@provider("paged_attention", name="blind_decode_value_offset", priority=PRIORITY, dtypes=F16)
def decode_value_offset(
    query, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # BUG: the value cache's base pointer is its storage's: value_cache = kv[:, 1] of a [blocks, 2, ...] buffer reads the keys
    return _decode(
        query, key_cache, _from_storage_start(value_cache), block_tables, seq_lens, scale, sliding_window, soft_cap
    )


@provider("paged_attention", name="blind_decode_split_kv", priority=PRIORITY, dtypes=F32)
def decode_split_kv(
    query, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window: int = 0, soft_cap: float = 0.0
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    if query.shape[0] != 1:
        return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    # a lone sequence (batch of one) takes the split-KV path: partitions of 512 keys, merged by log-sum-exp
    # BUG: the merge loops over seq_len // 512 partitions, dropping a partial last one
    whole = int(seq_lens[0]) // PARTITION * PARTITION
    hide = (lambda _blocks, pos: (pos >= whole)[None, :]) if whole > 0 else None
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, hide=hide)


# -------------------------------------------------------------------------------------------------
# prefill_attention
# -------------------------------------------------------------------------------------------------

Q_TILE = 64


@provider("prefill_attention", name="blind_prefill_int64_lens", priority=PRIORITY, dtypes=BF16)
def prefill_int64_lens(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len: int, scale: float,
    sliding_window: int = 0, soft_cap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    check_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, soft_cap
    )  # fmt: skip
    # BUG: one instantiation, for the int32 lengths the engine passes: int64 seq_lens are read as 32-bit words
    lens = _int64_as_int32_words(seq_lens) if seq_lens.dtype == torch.int64 else seq_lens
    return _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, lens, scale, sliding_window, soft_cap)


@provider("prefill_attention", name="blind_prefill_cap_drops_window", priority=PRIORITY, dtypes=F32)
def prefill_cap_drops_window(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len: int, scale: float,
    sliding_window: int = 0, soft_cap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    check_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, soft_cap
    )  # fmt: skip
    # BUG: the soft-cap variant of the kernel (Gemma 2) was written without the sliding window
    window = 0 if soft_cap > 0 else sliding_window
    return _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, window, soft_cap)


@provider("prefill_attention", name="blind_prefill_tile_causal", priority=PRIORITY, dtypes=F16)
def prefill_tile_causal(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len: int, scale: float,
    sliding_window: int = 0, soft_cap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    check_prefill_attention(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window, soft_cap
    )  # fmt: skip
    # BUG: a query row's causal limit is taken from its offset in its 64-row query tile, not in its sequence:
    # rows past a sequence's first 64 query tokens see too few keys
    return _prefill(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, soft_cap,
        row_pos=lambda j: j % Q_TILE,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------------
# sample
# -------------------------------------------------------------------------------------------------


@provider("sample", name="blind_sample_top_k_minus_one", priority=PRIORITY, dtypes=F32)
def sample_top_k_minus_one(logits, temperature, top_k, top_p, seeds) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    # BUG: only top_k == 0 means "no top-k": the engine's default -1 clamps to k = 1 and the row turns greedy
    return _sample(
        logits, temperature, top_k, top_p, seeds,
        k_of=lambda k, vocab: torch.where(k == 0, vocab, k.long()).clamp(1, vocab),
    )  # fmt: skip


@provider("sample", name="blind_sample_top_p_one_skips", priority=PRIORITY, dtypes=BF16)
def sample_top_p_one_skips(logits, temperature, top_k, top_p, seeds) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    # BUG: rows at the default top_p = 1.0 skip the filter stage, which also holds top-k: top_k is ignored there
    return _sample(logits, temperature, top_k, top_p, seeds, filtered_rows=lambda p: p < 1.0)


@provider("sample", name="blind_sample_seeds_offset", priority=PRIORITY, dtypes=F16)
def sample_seeds_offset(logits, temperature, top_k, top_p, seeds) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    # BUG: seeds read from their storage's start: the engine's seeds are the last slice of one int64 upload
    return _sample(logits, temperature, top_k, top_p, _from_storage_start(seeds))


@provider("sample", name="blind_sample_int32_top_k", priority=PRIORITY, dtypes=F32)
def sample_int32_top_k(logits, temperature, top_k, top_p, seeds) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    # BUG: one instantiation, for the int64 top_k the engine passes: int32 top_k are read as int64 words
    read = _int32_words_as_int64(top_k) if top_k is not None and top_k.dtype == torch.int32 else top_k
    return _sample(logits, temperature, read, top_p, seeds)


PROVIDERS: list[Provider] = [
    embedding_last_row,
    embedding_shard_offset,
    rms_norm_tail_tile,
    rms_norm_view_offset,
    fused_add_persistent_rows,
    fused_add_decode_row,
    rotary_table_ring,
    rotary_last_row,
    rotary_3d_heads,
    rotary_positions_offset,
    silu_leading_dims,
    gelu_tail_tile,
    linear_gemv_bias,
    linear_k_tail,
    linear_a_offset,
    cache_int32_slots,
    cache_row_block,
    cache_slots_offset,
    decode_int64_tables,
    decode_cap_after_window,
    decode_null_last_block,
    decode_value_offset,
    decode_split_kv,
    prefill_int64_lens,
    prefill_cap_drops_window,
    prefill_tile_causal,
    sample_top_k_minus_one,
    sample_top_p_one_skips,
    sample_seeds_offset,
    sample_int32_top_k,
]
'''

BLIND_COMM_INT64_SOURCE = r'''"""A vendor's platform plugin ("blind-comm-int64") whose collectives part carries one planted bug.

Integer all_reduce staged through float32. The platform is the host CPU; the ops are the references
under the plugin's name and every other part is core's default: only the collectives part is the
vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.comm import Collectives, TorchCollectives
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-comm-int64"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-comm-int64 emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-comm-int64 runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


class FloatEngineCollectives(TorchCollectives):
    """Collectives on a reduction engine that sums floating-point data only.

    BUG: integer tensors are staged through float32 for the sum and converted back, which is exact
    only below 2^24: an int64 (or int32) all_reduce of larger values (token counts, offsets, ids
    of a 128k vocabulary times a batch) comes back rounded.
    """

    name = "blind float-engine collectives"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, torch.Tensor) and tensor.dtype in (torch.int64, torch.int32):
            staged = tensor.to(torch.float32)
            super().all_reduce(staged)
            tensor.copy_(staged.round().to(tensor.dtype))
            return tensor
        return super().all_reduce(tensor)


@hookimpl
def vllm_port_collectives(platform: PlatformDescription) -> Collectives | None:
    return FloatEngineCollectives() if platform.name == NAME else None
'''

BLIND_COMM_64K_SOURCE = r'''"""A vendor's platform plugin ("blind-comm-64k") whose collectives part carries one planted bug.

All_reduce past 64 KiB loses its last partial chunk. The platform is the host CPU; the ops are the
references under the plugin's name and every other part is core's default: only the collectives part is
the vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.comm import Collectives, TorchCollectives
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-comm-64k"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-comm-64k emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-comm-64k runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


#: bytes one transfer of the vendor's ring moves
CHUNK_BYTES = 64 << 10


class ChunkedRingCollectives(TorchCollectives):
    """Collectives whose all_reduce moves a message in 64 KiB chunks.

    BUG: the chunk count is ``nbytes // 64 KiB``: a message past 64 KiB that is not a whole number
    of chunks (a decode step's [n, 4096] float32 partial sums for n not a multiple of 4) keeps its
    last partial chunk unreduced, each rank its own values.
    """

    name = "blind chunked-ring collectives"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor) or tensor.numel() * tensor.element_size() <= CHUNK_BYTES:
            return super().all_reduce(tensor)
        flat = tensor.contiguous().view(-1)
        per_chunk = CHUNK_BYTES // tensor.element_size()
        whole = flat.numel() // per_chunk * per_chunk
        for start in range(0, whole, per_chunk):
            super().all_reduce(flat[start : start + per_chunk])
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor


@hookimpl
def vllm_port_collectives(platform: PlatformDescription) -> Collectives | None:
    return ChunkedRingCollectives() if platform.name == NAME else None
'''

BLIND_COMM_ODD_SOURCE = r'''"""A vendor's platform plugin ("blind-comm-odd") whose collectives part carries one planted bug.

All_gather's bulk path drops an odd tail element. The platform is the host CPU; the ops are the
references under the plugin's name and every other part is core's default: only the collectives part is
the vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch
import torch.distributed as dist

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.comm import Collectives, TorchCollectives
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-comm-odd"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-comm-odd emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-comm-odd runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


#: messages of at least this many bytes take the bulk protocol, which moves 8-byte words
BULK_BYTES = 1024
WORD_BYTES = 8


class WordBulkCollectives(TorchCollectives):
    """Collectives whose all_gather sends a rank's shard as 8-byte words once it is 1 KiB or more.

    BUG: the bulk protocol moves ``nbytes // 8`` words and has no tail: a shard whose element count
    is not a whole number of words (an odd count of float32, a count of bfloat16 not divisible by
    4) arrives on the other ranks without its last elements (zeros here; stale memory on a device).
    """

    name = "blind word-bulk collectives"

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        out = super().all_gather(tensor, dim)
        per_word = max(1, WORD_BYTES // tensor.element_size())
        world, rank = dist.get_world_size(), dist.get_rank()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([tensor.shape[dim % tensor.dim()]], dtype=torch.int64))
        moved = out.movedim(dim, 0)
        start = 0
        for peer, size in enumerate(int(s) for s in sizes):
            shard = moved[start : start + size]
            start += size
            tail = shard.numel() % per_word
            if peer == rank or tail == 0 or shard.numel() * shard.element_size() < BULK_BYTES:
                continue
            staged = shard.contiguous()
            staged.view(-1)[-tail:] = 0
            shard.copy_(staged)
        return out


@hookimpl
def vllm_port_collectives(platform: PlatformDescription) -> Collectives | None:
    return WordBulkCollectives() if platform.name == NAME else None
'''

BLIND_MIGRATOR_RING_SOURCE = r'''"""A vendor's platform plugin ("blind-migrator-ring") whose migrator carries one planted bug.

Swaps of more than 64 blocks overwrite their own copy descriptors. The platform is the host CPU; the
ops are the references under the plugin's name and every other part is core's default: only the
migrator is the vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Migrator, TorchMigrator
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-migrator-ring"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-migrator-ring emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-migrator-ring runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


#: copy descriptors the vendor's DMA engine holds per submission
RING = 64


class DescriptorRingMigrator(TorchMigrator):
    """Block copies submitted to a DMA engine through a ring of 64 copy descriptors.

    BUG: the descriptors of one swap are written at ``i % 64`` without waiting for the ring to drain:
    a swap of more than 64 blocks overwrites its own first descriptors, so only the last pair
    written into each slot is copied and the blocks before them are never moved.
    """

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]):
        ring: list[tuple[int, int] | None] = [None] * RING
        for i, pair in enumerate(zip(src_ids, dst_ids, strict=True)):
            ring[i % RING] = pair
        kept = [pair for pair in ring if pair is not None]
        return super()._launch(src, dst, [a for a, _ in kept], [b for _, b in kept])


@hookimpl
def vllm_port_migrator(platform: PlatformDescription) -> Migrator | None:
    return DescriptorRingMigrator() if platform.name == NAME else None
'''

BLIND_MIGRATOR_LAST_SOURCE = r'''"""A vendor's platform plugin ("blind-migrator-last") whose migrator carries one planted bug.

A copy touching a pool's last block is silently dropped. The platform is the host CPU; the ops are
the references under the plugin's name and every other part is core's default: only the migrator is
the vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Migrator, TorchMigrator
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-migrator-last"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-migrator-last emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-migrator-last runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


class GuardedMigrator(TorchMigrator):
    """Block copies with the DMA engine's own bounds guard on every pair.

    BUG: the guard is written ``block < num_blocks - 1``: a pair whose source or destination is
    the last block of its pool is dropped without a word, so swapping out or in through the
    pool's last block leaves that block's keys and values behind.
    """

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]):
        kept = [(a, b) for a, b in zip(src_ids, dst_ids, strict=True) if a < src.shape[0] - 1 and b < dst.shape[0] - 1]
        if not kept:
            return None
        return super()._launch(src, dst, [a for a, _ in kept], [b for _, b in kept])


@hookimpl
def vllm_port_migrator(platform: PlatformDescription) -> Migrator | None:
    return GuardedMigrator() if platform.name == NAME else None
'''

BLIND_ALLOCATOR_ARENA_SOURCE = r'''"""A vendor's platform plugin ("blind-allocator-arena") whose allocator carries one planted bug.

Large buffers from a huge-page arena overlap. The platform is the host CPU; the ops are the
references under the plugin's name and every other part is core's default: only the allocator is the
vendor's, and it is wrong only where its docstring says.
"""

from __future__ import annotations

import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Allocator, HostMemoryAllocator
from vllm_port.ops import ALL_OPS, Provider, provider

NAME = "blind-allocator-arena"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return PlatformDescription(name=NAME, device_type="cpu", priority=-10, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    device = DeviceInfo(name="host CPU (blind-allocator-arena emulator)", arch=_host.machine())
    return ProbeResult(True, "blind-allocator-arena runs on the host CPU", (device,))


@hookimpl
def vllm_port_providers() -> list[Provider]:
    """Every op as its reference, under this plugin's name: the vendor has no kernels of its own yet."""
    prefix = NAME.replace("-", "_")
    return [provider(op.name, name=f"{prefix}_reference_{op.name}", priority=10)(op.reference) for op in ALL_OPS]


HUGE_PAGE = 2 << 20
#: requests of at least this many bytes come from the huge-page arena
ARENA_FROM = 4 * HUGE_PAGE
#: the arena reserves address space this large at a time (pages are committed only when touched)
SLAB = 4 << 30


class ArenaAllocator(HostMemoryAllocator):
    """Host memory with an arena of 2 MiB huge pages for large buffers (KV caches, swap space).

    Large buffers are carved one after the other from a reserved slab, which is given back once
    its last buffer is freed. BUG: the arena's bump pointer advances by the request rounded *down*
    to whole huge pages: a large buffer whose size is not a multiple of 2 MiB overlaps the next
    large buffer by the remainder, so writing one (the KV cache) overwrites the start of the other
    (the swap space).
    """

    def __init__(self) -> None:
        super().__init__(pinned=False, name="blind arena allocator")
        self._slab: torch.Tensor | None = None
        self._top = 0
        self._slabs: dict[int, list] = {}  # slab address -> [slab, live buffers carved from it]

    def _alloc(self, nbytes: int) -> torch.Tensor:
        if nbytes < ARENA_FROM:
            return super()._alloc(nbytes)
        if self._slab is None or self._top + nbytes > self._slab.numel():
            self._slab = torch.empty(max(SLAB, -(-nbytes // HUGE_PAGE) * HUGE_PAGE), dtype=torch.uint8)
            self._top = 0
            self._slabs[self._slab.data_ptr()] = [self._slab, 0]
        buffer = self._slab[self._top : self._top + nbytes]
        self._slabs[self._slab.data_ptr()][1] += 1
        self._top += nbytes // HUGE_PAGE * HUGE_PAGE
        return buffer

    def _free(self, buffer: torch.Tensor) -> None:
        entry = self._slabs.get(buffer.untyped_storage().data_ptr())
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:  # the slab's last buffer: give the slab back
            del self._slabs[entry[0].data_ptr()]
            if self._slab is entry[0]:
                self._slab, self._top = None, 0


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return ArenaAllocator() if platform.name == NAME else None
'''

BLIND: list[BlindPlugin] = [
    BlindPlugin(
        "blind-ops",
        BLIND_OPS_SOURCE,
        (
            BlindBug(
                "blind_embedding_last_row",
                "embedding",
                "ids equal to vocab_size - 1 read zeros (bound written `id < vocab_size - 1`)",
                "last row of an indexed table",
            ),
            BlindBug(
                "blind_embedding_shard_offset",
                "embedding",
                "the table is read from its storage's start: a vocabulary shard table[start:end] returns rows of the first shard",
                "view at a non-zero storage offset",
            ),
            BlindBug(
                "blind_rms_norm_tail_tile",
                "rms_norm",
                "rows wider than 256 sum squares over whole 256-column tiles only: a width like 5504 (11008 / 2) leaves its tail out of the variance",
                "inner size not a multiple of the tile",
            ),
            BlindBug(
                "blind_rms_norm_view_offset",
                "rms_norm",
                "x is read from its storage's start: a view at a non-zero offset normalises the wrong rows",
                "view at a non-zero storage offset",
            ),
            BlindBug(
                "blind_fused_add_persistent_rows",
                "fused_add_rms_norm",
                "a persistent grid of 64 programs stores the residual at the program's row: past 64 rows the residual is wrong",
                "row count past a tile boundary (more than 64 rows)",
            ),
            BlindBug(
                "blind_fused_add_decode_row",
                "fused_add_rms_norm",
                "the one-row latency path never writes the residual back",
                "one-row (decode) input",
            ),
            BlindBug(
                "blind_rotary_table_ring",
                "rotary_embedding",
                "cos/sin rows staged in an 8192-entry ring (`pos & 8191`): positions past 8k rotate by the wrong angle",
                "rotary positions past 8k",
            ),
            BlindBug(
                "blind_rotary_last_row",
                "rotary_embedding",
                "positions clamped to max_position - 2: the cos_sin_cache's last row is never read",
                "rotary positions: the table's last row",
            ),
            BlindBug(
                "blind_rotary_3d_heads",
                "rotary_embedding",
                "heads counted as size(-1) // head_size: a 3-D [tokens, heads, head_size] input rotates head 0 only",
                "3-D input where the contract allows it",
            ),
            BlindBug(
                "blind_rotary_positions_offset",
                "rotary_embedding",
                "positions read from their storage's start: the engine's positions (a slice of one int64 upload) read as the token ids",
                "index tensors the engine passes (offset slices of one upload)",
            ),
            BlindBug(
                "blind_silu_leading_dims",
                "silu_and_mul",
                "rows = x.size(0): a 3-D [batch, tokens, 2d] input is split in halves of tokens * 2d",
                "3-D input where the contract allows it",
            ),
            BlindBug(
                "blind_gelu_tail_tile",
                "gelu_and_mul",
                "past one 64-column tile the store mask is `col < d // 64 * 64`: the last partial tile stays unwritten (d = 1376 = 11008 / 8)",
                "inner size not a multiple of 64",
            ),
            BlindBug(
                "blind_linear_gemv_bias", "linear", "the one-row GEMV path drops the bias", "one-row (decode) input"
            ),
            BlindBug(
                "blind_linear_k_tail",
                "linear",
                "the K loop covers whole 256-wide tiles only: in_features 5504 (a TP-2 down_proj shard) drops its last 128",
                "inner size not a multiple of the tile",
            ),
            BlindBug(
                "blind_linear_a_offset",
                "linear",
                "x is read from its storage's start: a view at a non-zero offset multiplies the wrong rows",
                "view at a non-zero storage offset",
            ),
            BlindBug(
                "blind_cache_int32_slots",
                "reshape_and_cache",
                "int32 slot_mapping read as int64 words (one instantiation, for the engine's int64): the slots fall outside the cache and are dropped",
                "int32 vs int64 metadata (slot_mapping)",
            ),
            BlindBug(
                "blind_cache_row_block",
                "reshape_and_cache",
                "one program per token with a block of at most 2048 elements: a 32 x 128 = 4096-wide MHA row is written half",
                "4096-wide MHA cache rows",
            ),
            BlindBug(
                "blind_cache_slots_offset",
                "reshape_and_cache",
                "slot_mapping read from its storage's start: the engine's slots (a slice of one int64 upload) read as the token ids",
                "index tensors the engine passes (offset slices of one upload)",
            ),
            BlindBug(
                "blind_decode_int64_tables",
                "paged_attention",
                "int64 block_tables read as 32-bit words (one instantiation, for the engine's int32)",
                "int32 vs int64 metadata (block_tables)",
            ),
            BlindBug(
                "blind_decode_cap_after_window",
                "paged_attention",
                "the window's -inf is written into the scores before the soft cap, which turns it into -soft_cap: with both, keys outside the window keep weight",
                "arguments in combination (soft cap with sliding window)",
            ),
            BlindBug(
                "blind_decode_null_last_block",
                "paged_attention",
                "the pool's last block is taken for the engine's null block and its keys are skipped",
                "last row of an indexed table (the last cache block)",
            ),
            BlindBug(
                "blind_decode_value_offset",
                "paged_attention",
                "value_cache read from its storage's start: with value_cache = kv[:, 1] of one [blocks, 2, ...] buffer the keys are read as values",
                "view at a non-zero storage offset",
            ),
            BlindBug(
                "blind_decode_split_kv",
                "paged_attention",
                "a batch of one sequence takes a split-KV path whose merge drops a partial last 512-key partition",
                "one-row (decode) input: a batch of one sequence",
            ),
            BlindBug(
                "blind_prefill_int64_lens",
                "prefill_attention",
                "int64 seq_lens read as 32-bit words (one instantiation, for the engine's int32)",
                "int32 vs int64 metadata (seq_lens)",
            ),
            BlindBug(
                "blind_prefill_cap_drops_window",
                "prefill_attention",
                "the soft-cap kernel variant ignores the sliding window",
                "arguments in combination (soft cap with sliding window)",
            ),
            BlindBug(
                "blind_prefill_tile_causal",
                "prefill_attention",
                "a query row's causal limit comes from its offset in its 64-row tile: rows past a sequence's first 64 see too few keys",
                "token count past a tile boundary (more than 64 query rows)",
            ),
            BlindBug(
                "blind_sample_top_k_minus_one",
                "sample",
                "only top_k == 0 disables top-k: the engine's default -1 clamps to k = 1 (greedy)",
                "engine defaults (top_k = -1)",
            ),
            BlindBug(
                "blind_sample_top_p_one_skips",
                "sample",
                "rows at the default top_p = 1.0 skip the filter stage, losing their top_k",
                "engine defaults (top_p = 1.0)",
            ),
            BlindBug(
                "blind_sample_seeds_offset",
                "sample",
                "seeds read from their storage's start: the engine's seeds (a slice of one int64 upload) read as top_k",
                "index tensors the engine passes (offset slices of one upload)",
            ),
            BlindBug(
                "blind_sample_int32_top_k",
                "sample",
                "int32 top_k read as int64 words (one instantiation, for the engine's int64): top-k lost",
                "int32 vs int64 metadata (top_k)",
            ),
        ),
    ),
    BlindPlugin(
        "blind-comm-int64",
        BLIND_COMM_INT64_SOURCE,
        (
            BlindBug(
                "communicator",
                "all_reduce",
                "integer all_reduce staged through float32: int64 sums above 2^24 come back rounded",
                "comm: int64 all_reduce above 2^24",
            ),
        ),
    ),
    BlindPlugin(
        "blind-comm-64k",
        BLIND_COMM_64K_SOURCE,
        (
            BlindBug(
                "communicator",
                "all_reduce",
                "messages past 64 KiB go in 64 KiB chunks and a partial last chunk is never reduced",
                "comm: messages past 64 KiB",
            ),
        ),
    ),
    BlindPlugin(
        "blind-comm-odd",
        BLIND_COMM_ODD_SOURCE,
        (
            BlindBug(
                "communicator",
                "all_gather",
                "shards of 1 KiB or more move as 8-byte words with no tail: an odd float32 count loses its last element on the other ranks",
                "comm: an odd element count",
            ),
        ),
    ),
    BlindPlugin(
        "blind-migrator-ring",
        BLIND_MIGRATOR_RING_SOURCE,
        (
            BlindBug(
                "migrator",
                "copy_blocks",
                "copy descriptors written at i % 64 into a 64-entry ring: swaps of more than 64 blocks skip their first ones",
                "memory: swaps of more than 64 blocks",
            ),
        ),
    ),
    BlindPlugin(
        "blind-migrator-last",
        BLIND_MIGRATOR_LAST_SOURCE,
        (
            BlindBug(
                "migrator",
                "copy_blocks",
                "bounds guard `block < num_blocks - 1`: copies to or from a pool's last block are dropped",
                "memory: the last block of a pool",
            ),
        ),
    ),
    BlindPlugin(
        "blind-allocator-arena",
        BLIND_ALLOCATOR_ARENA_SOURCE,
        (
            BlindBug(
                "allocator",
                "allocate",
                "buffers of 8 MiB or more come from a huge-page arena whose bump pointer rounds down to 2 MiB: consecutive large buffers overlap",
                "memory: an allocator off on large sizes",
            ),
        ),
    ),
]
