"""Rotary position embedding, applied in place to query and key."""

from __future__ import annotations

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
    reads_values,
)
from ._op import ErrorInput, IndexedTable, Op, SampleInput, Tolerance, Variants


def check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox) -> None:
    """Refuse arguments outside ``rotary_embedding``'s contract; positions are checked against the cache under validation."""
    op = "rotary_embedding"
    if (
        not isinstance(positions, torch.Tensor)
        or positions.dtype not in (torch.int32, torch.int64)
        or positions.dim() != 1
    ):
        got = (
            f"{positions.dtype} of {positions.dim()} dims"
            if isinstance(positions, torch.Tensor)
            else type(positions).__name__
        )
        raise OpInputError(f"{op}: positions must be a 1-D int32/int64 tensor of token positions, got {got}")
    check_float(op, "query", query)
    check_float(op, "key", key)
    check_same(op, "key", key, "query", query)
    check_index(op, "positions", positions, 1, "query", query)
    check_float(op, "cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.device != query.device:
        raise OpInputError(
            f"{op}: cos_sin_cache is on {cos_sin_cache.device} but query is on {query.device}; move it to one device"
        )
    check_int(op, "head_size", head_size, 1, "features per head")
    for arg, t in (("query", query), ("key", key)):
        if (
            t.dim() not in (2, 3)
            or t.shape[0] != positions.shape[0]
            or t.shape[-1] % head_size
            or (t.dim() == 3 and t.shape[-1] != head_size)
        ):
            raise OpInputError(
                f"{op}: {arg} has shape {tuple(t.shape)}; it must be [tokens, heads * {head_size}] or "
                f"[tokens, heads, {head_size}] with one row per position ({positions.shape[0]})"
            )
    rot_dim = cos_sin_cache.shape[-1] if cos_sin_cache.dim() == 2 and cos_sin_cache.shape[0] > 0 else -1
    if rot_dim <= 0 or rot_dim % 2 or rot_dim > head_size:
        raise OpInputError(
            f"{op}: cos_sin_cache has shape {tuple(cos_sin_cache.shape)}; it must be [max_position, rotary_dim] "
            f"with max_position >= 1 and rotary_dim even and <= head_size {head_size} (cos in the first half, "
            "sin in the second)"
        )
    if not isinstance(is_neox, bool):
        raise OpInputError(f"{op}: is_neox must be a bool (True: rotate halves, False: GPT-J interleaved pairs)")
    check_writable(op, "query", query)
    check_writable(op, "key", key)
    if reads_values(positions):
        max_position = cos_sin_cache.shape[0]
        check_values_in(
            op,
            "positions",
            positions,
            0,
            max_position,
            f"cos_sin_cache holds {max_position} positions; build it for the model's longest context "
            "(max_position_embeddings) or keep the sequence within it",
        )


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate the first ``rotary_dim`` features of every head of ``query`` and ``key`` in place.

    ``cos_sin_cache[p]`` holds ``rotary_dim / 2`` cosines then as many sines for position ``p``.
    NeoX style (``is_neox``) pairs feature ``i`` with ``i + rotary_dim / 2``; GPT-J style pairs
    ``2i`` with ``2i + 1``. Features past ``rotary_dim`` (partial rotary) are left as they are.
    The rotation is computed in float32 and rounded once to the input's dtype.

    ``query`` and ``key`` may be views (slices of a fused QKV projection, ``[tokens, heads,
    head_size]`` or ``[tokens, heads * head_size]`` with rows further apart than their length):
    they are rotated through the views, and nothing else of their storage is written.
    """
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    rot = cos_sin_cache.shape[-1]
    compute = torch.promote_types(query.dtype, torch.float32)
    cos, sin = cos_sin_cache[positions.long()].to(compute).chunk(2, dim=-1)  # [tokens, rot / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    for t in (query, key):
        heads = t.unflatten(-1, (-1, head_size)) if t.dim() == 2 else t
        x = heads[..., :rot].to(compute)
        x1, x2 = (x[..., : rot // 2], x[..., rot // 2 :]) if is_neox else (x[..., 0::2], x[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
        heads[..., :rot] = rotated.to(t.dtype)


def make_cos_sin_cache(
    max_position: int, rotary_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The standard RoPE table: ``[max_position, rotary_dim]``, cosines then sines."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)


def _samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    tables: dict[int, torch.Tensor] = {}

    def table(rot: int) -> torch.Tensor:
        if rot not in tables:
            tables[rot] = make_cos_sin_cache(8192, rot).to(device)
        return tables[rot]

    def case(label: str, tokens: int, heads: int, kv_heads: int, head_size: int, rot: int, neox: bool) -> SampleInput:
        positions = torch.randint(0, 8192, (tokens,), generator=gen).to(device)
        q = torch.randn(tokens, heads * head_size, generator=gen).to(device, dtype)
        k = torch.randn(tokens, kv_heads * head_size, generator=gen).to(device, dtype)
        return SampleInput(label, (positions, q, k, head_size, table(rot), neox))

    def fused_qkv(label: str, three_d: bool, neox: bool) -> SampleInput:
        """query and key as slices of one [tokens, (heads + 2 * kv_heads) * head_size] projection."""
        tokens, heads, kv_heads, head_size = 6, 4, 2, 64
        positions = torch.randint(0, 8192, (tokens,), generator=gen).to(device, torch.int32)
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(device, dtype)
        q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
        if three_d:
            q, k = q.unflatten(-1, (heads, head_size)), k.unflatten(-1, (kv_heads, head_size))
        return SampleInput(label, (positions, q, k, head_size, table(head_size), neox))

    def long_table(label: str, tokens: int) -> SampleInput:
        """Positions across a 32768-position table (a 32k context), past 8k and 16k, its last row included."""
        positions = torch.randint(0, _LONG_TABLE, (tokens,), generator=gen)
        positions[-1] = _LONG_TABLE - 1
        q = torch.randn(tokens, 4 * 128, generator=gen).to(device, dtype)
        k = torch.randn(tokens, 2 * 128, generator=gen).to(device, dtype)
        table = make_cos_sin_cache(_LONG_TABLE, 128).to(device)
        return SampleInput(label, (positions.to(device), q, k, 128, table, True))

    return [
        case("small neox", 5, 4, 2, 64, 64, True),
        case("small gpt-j", 5, 4, 2, 64, 64, False),
        case("partial rotary neox", 3, 4, 4, 64, 32, True),
        case("partial rotary gpt-j", 3, 4, 4, 64, 16, False),
        case("llama3-8b decode", 4, 32, 8, 128, 128, True),
        case("llama3-8b prefill", 64, 32, 8, 128, 128, True),
        case("head size 80, partial rotary 32 (phi-2)", 5, 4, 4, 80, 32, True),
        case("head size 96, gpt-j", 5, 4, 2, 96, 96, False),
        case("head size 256 (gemma)", 4, 8, 4, 256, 256, True),
        fused_qkv("query and key slices of a fused qkv", False, True),
        fused_qkv("[tokens, heads, head_size] views of a fused qkv, gpt-j", True, False),
        long_table("positions past 8k of a 32768-position table, its last row", 9),
    ]


#: Positions of the long-context sample's table: past 8192 (where most samples' tables end) and 16384.
_LONG_TABLE = 32768


def _errors(device: torch.device) -> list[ErrorInput]:
    pos = torch.arange(2, device=device)
    q, k = torch.randn(2, 128, device=device), torch.randn(2, 64, device=device)
    cache = make_cos_sin_cache(16, 64).to(device)
    return [
        ErrorInput("float positions", (pos.float(), q, k, 64, cache, True), "positions must be"),
        ErrorInput("head size not dividing query", (pos, q, k, 48, cache, True), "query has shape"),
        ErrorInput("rotary dim above head size", (pos, q, k, 32, cache, True), "rotary_dim even and <= head_size"),
        ErrorInput("key of another dtype", (pos, q, k.half(), 64, cache, True), "cast them to one dtype"),
        ErrorInput("is_neox not a bool", (pos, q, k, 64, cache, 1), "is_neox must be a bool"),
        ErrorInput("key an expanded view", (pos, q, k[:1].expand(2, 64), 64, cache, True), "key is an expanded view"),
    ]


def _value_errors(device: torch.device) -> list[ErrorInput]:
    q, k = torch.randn(2, 128, device=device), torch.randn(2, 64, device=device)
    cache = make_cos_sin_cache(16, 64).to(device)
    past = torch.tensor([3, 16], device=device)
    negative = torch.tensor([-1, 0], dtype=torch.int32, device=device)
    return [
        ErrorInput("position past the cache", (past, q, k, 64, cache, True), "positions[1] is 16, outside [0, 16)"),
        ErrorInput("negative position", (negative, q, k, 64, cache, True), "positions[0] is -1"),
    ]


rotary_embedding = Op(
    name="rotary_embedding",
    reference=rotary_embedding_reference,
    tolerances={
        torch.float32: Tolerance(1e-5, 1e-5, "float32 sin/cos products in another order differ by a few ulps"),
        torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bfloat16 output keeps 8 significant bits, rounded once"),
        torch.float16: Tolerance(1e-3, 2e-3, "float16 output keeps 11 significant bits, rounded once"),
    },
    hand_samples=_samples,
    errors=_errors,
    value_errors=_value_errors,
    mutates=("query", "key"),
    fake=lambda positions, query, key, head_size, cos_sin_cache, is_neox: None,
    variants=Variants(
        base="small neox",
        index={"positions": INDEX_DTYPES},
        rows=("positions", "query", "key"),
        tables=(IndexedTable("positions", ("cos_sin_cache",)),),
    ),
)
