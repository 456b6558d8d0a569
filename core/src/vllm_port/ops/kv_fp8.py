"""The paged KV cache in FP8: the three cache ops over ``float8_e4m3fn`` caches with per-tensor scales.

``reshape_and_cache_fp8``, ``paged_attention_fp8`` and ``prefill_attention_fp8`` are ``reshape_and_cache``,
``paged_attention`` and ``prefill_attention`` (:mod:`vllm_port.ops.attention`: the layout, padding and value
rules are theirs) with two more arguments, ``k_scale`` and ``v_scale`` (positive finite floats, per tensor,
vLLM's ``kv_cache_dtype="fp8"`` with its default scales of 1.0 or a checkpoint's calibrated ones). The cache
holds ``e4m3(key / k_scale)``: the division in float32, rounded to nearest even, saturated at +-448; a
reader multiplies by the scale back.

Why ops of their own and not an optional dtype of the existing three: those are certified by every plugin
with every kernel (native CPU, Triton, Hopper's Gluon prefill, ROCm's and XPU's libraries) for float caches;
an FP8 cache adds two arguments and a write that rounds, and a plugin with no FP8 path keeps its certified
float ops and falls back to the references here.

Oracles: the write is exact (a provider rounds exactly as stated, so its bytes equal the reference's); the
attention ops are the float attention of their references over the dequantised caches in float64, with the
float ops' tolerances (the cache's values are the input; a provider folds ``k_scale`` into the score scale and
``v_scale`` into the output, which is exact up to float32 rounding).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from ..errors import OpInputError
from ._checks import check_float, check_index, check_writable, reads_values
from ._op import ErrorInput, Op, SampleInput, Tolerance
from .attention import (
    _check_paged_batch,
    _check_prefill_batch,
    _check_slots,
    decode_attend,
    paged_attention,
    prefill_attend,
    prefill_attention,
    reshape_and_cache,
)
from .fp8 import FP8_DTYPE, FP8_MAX

__all__ = [
    "K_SCALE",
    "V_SCALE",
    "check_paged_attention_fp8",
    "check_prefill_attention_fp8",
    "check_reshape_and_cache_fp8",
    "compact_blocks",
    "dequantize_kv",
    "paged_attention_fp8",
    "prefill_attention_fp8",
    "quantize_kv",
    "reshape_and_cache_fp8",
]

_DIMS = ("num_blocks", "block_size", "num_kv_heads", "head_size")


def check_fp8_cache(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Refuse caches that are not two ``float8_e4m3fn`` ``[num_blocks, block_size, num_kv_heads, head_size]``."""
    for arg, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not isinstance(cache, torch.Tensor) or cache.dtype != FP8_DTYPE:
            got = cache.dtype if isinstance(cache, torch.Tensor) else type(cache).__name__
            raise OpInputError(
                f"{op}: {arg} must be a torch.float8_e4m3fn tensor, got {got}; a float cache goes to "
                f"{op.removesuffix('_fp8')}"
            )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.device != value_cache.device:
        raise OpInputError(
            f"{op}: key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both be "
            "[num_blocks, block_size, num_kv_heads, head_size], on one device"
        )
    if min(key_cache.shape) < 1:
        empty = [name for name, size in zip(_DIMS, key_cache.shape, strict=True) if size < 1]
        raise OpInputError(f"{op}: key_cache has {' and '.join(empty)} 0; every dimension must be at least 1")
    return tuple(key_cache.shape)  # type: ignore[return-value]


def _check_scales(op: str, k_scale: float, v_scale: float) -> None:
    for arg, value in (("k_scale", k_scale), ("v_scale", v_scale)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise OpInputError(f"{op}: {arg} must be a positive finite float (1.0: no scaling), got {value!r}")


def _check_on(op: str, arg: str, value: torch.Tensor, cache: torch.Tensor) -> None:
    if value.device != cache.device:
        raise OpInputError(
            f"{op}: {arg} is on {value.device} but key_cache is on {cache.device}; move them to one device"
        )


def check_reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """Refuse arguments outside ``reshape_and_cache_fp8``'s contract."""
    op = "reshape_and_cache_fp8"
    _, _, kv_heads, head_size = check_fp8_cache(op, key_cache, value_cache)
    check_float(op, "key", key)
    check_float(op, "value", value)
    _check_on(op, "key", key, key_cache)
    _check_on(op, "value", value, key_cache)
    if key.dim() != 3 or key.shape != value.shape or tuple(key.shape[1:]) != (kv_heads, head_size):
        raise OpInputError(
            f"{op}: key {tuple(key.shape)} and value {tuple(value.shape)} must both be [tokens, {kv_heads}, "
            f"{head_size}] (the cache's KV heads and head size)"
        )
    check_index(op, "slot_mapping", slot_mapping, 1, "key", key)
    if slot_mapping.shape[0] != key.shape[0]:
        raise OpInputError(f"{op}: slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    check_writable(op, "key_cache", key_cache)
    check_writable(op, "value_cache", value_cache)
    _check_scales(op, k_scale, v_scale)
    if reads_values(slot_mapping):
        _check_slots(op, slot_mapping, key_cache.shape[0], key_cache.shape[1])


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``e4m3(x / scale)``: the division in float32, rounded to nearest even, saturated at +-448 (NaN stays NaN)."""
    return (x.to(torch.float32) / torch.tensor(scale, dtype=torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``cache * scale`` in ``dtype`` (the product in float32, float64 for float64)."""
    compute = torch.promote_types(dtype, torch.float32)
    return (cache.to(compute) * scale).to(dtype)


def reshape_and_cache_fp8_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``quantize_kv(key[t], k_scale)`` and ``quantize_kv(value[t], v_scale)`` into slot ``slot_mapping[t]``.

    Slot -1 is a padded token (nothing written); see ``reshape_and_cache``.
    """
    check_reshape_and_cache_fp8(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    _write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _write(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    """The write without the checks: the oracle, which conformance runs on float64 copies of the caches."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // block_size, slots % block_size] = quantize_kv(key[keep], k_scale).to(key_cache.dtype)
    value_cache[slots // block_size, slots % block_size] = quantize_kv(value[keep], v_scale).to(value_cache.dtype)


def check_paged_attention_fp8(
    query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0, k_scale=1.0,
    v_scale=1.0,
) -> None:  # fmt: skip
    """Refuse arguments outside ``paged_attention_fp8``'s contract."""
    op = "paged_attention_fp8"
    _, _, kv_heads, head_size = check_fp8_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    _check_on(op, "query", query, key_cache)
    _check_scales(op, k_scale, v_scale)
    _check_paged_batch(
        op, query, key_cache, kv_heads, head_size, block_tables, seq_lens, scale, sliding_window, soft_cap
    )


def paged_attention_fp8_reference(
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
    """``paged_attention`` over the caches times their scales (in float32: see :func:`_dequantized`)."""
    check_paged_attention_fp8(
        query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, k_scale, v_scale
    )
    return _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap, k_scale,
                   v_scale)  # fmt: skip


def _decode(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window=0, soft_cap=0.0, k_scale=1.0,
            v_scale=1.0) -> torch.Tensor:  # fmt: skip
    """Decode without the FP8 checks (the oracle, on float64 copies of the caches)."""
    k, v = _dequantized(query, key_cache, value_cache, k_scale, v_scale)
    return decode_attend(query, k, v, block_tables, seq_lens, scale, sliding_window, soft_cap)


def check_prefill_attention_fp8(
    query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale, sliding_window=0,
    soft_cap=0.0, k_scale=1.0, v_scale=1.0,
) -> None:  # fmt: skip
    """Refuse arguments outside ``prefill_attention_fp8``'s contract."""
    op = "prefill_attention_fp8"
    _, _, kv_heads, head_size = check_fp8_cache(op, key_cache, value_cache)
    check_float(op, "query", query)
    _check_on(op, "query", query, key_cache)
    _check_scales(op, k_scale, v_scale)
    _check_prefill_batch(op, query, key_cache, kv_heads, head_size, block_tables, cu_seqlens_q, seq_lens,
                         max_query_len, scale, sliding_window, soft_cap)  # fmt: skip


def prefill_attention_fp8_reference(
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
    """``prefill_attention`` over the caches times their scales (in float32: see :func:`_dequantized`)."""
    check_prefill_attention_fp8(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len,
                                scale, sliding_window, soft_cap, k_scale, v_scale)  # fmt: skip
    return _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
                    sliding_window, soft_cap, k_scale, v_scale)  # fmt: skip


def _prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale,
             sliding_window=0, soft_cap=0.0, k_scale=1.0, v_scale=1.0) -> torch.Tensor:  # fmt: skip
    """Prefill without the FP8 checks (the oracle, on float64 copies of the caches)."""
    k, v = _dequantized(query, key_cache, value_cache, k_scale, v_scale)
    return prefill_attend(query, k, v, block_tables, cu_seqlens_q, seq_lens, scale, sliding_window, soft_cap)


def _dequantized(query, key_cache, value_cache, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Both caches times their scales in float32 (float64 for float64 queries): scores and the PV product see
    the e4m3 values scaled exactly, as a kernel that folds the scales into the score scale and the output does."""
    wide = torch.promote_types(query.dtype, torch.float32)
    return dequantize_kv(key_cache, k_scale, wide), dequantize_kv(value_cache, v_scale, wide)


def compact_blocks(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: float,
    v_scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the sequences read, dequantised to ``dtype`` and packed, and the block tables renumbered to them.

    A provider without FP8 arithmetic (the CPU's) runs its float attention on these: memory in proportion to the
    blocks read, never a float copy of the whole cache. Entries a sequence does not read become block 0.
    One host read (the blocks in use).
    """
    block_size = key_cache.shape[1]
    width = block_tables.shape[1]
    used = torch.arange(width, device=block_tables.device)[None, :] * block_size < seq_lens.long()[:, None]
    tables = torch.where(used, block_tables.long(), 0)
    flat = torch.cat([tables.flatten(), tables.new_zeros(1)])  # block 0 always: a batch of no sequence reads none
    blocks, renumbered = torch.unique(flat, return_inverse=True)
    renumbered = renumbered[:-1].view(tables.shape)
    k = dequantize_kv(key_cache.index_select(0, blocks), k_scale, dtype)
    v = dequantize_kv(value_cache.index_select(0, blocks), v_scale, dtype)
    return k, v, renumbered.to(block_tables.dtype)


# ------------------------------------------------------------------------------------------------
# Samples and errors: the float ops' own, their caches in e4m3 (scales that are not powers of two)
# ------------------------------------------------------------------------------------------------

#: The scales of the samples: not powers of two, and far from 1, so a provider that ignores one is far off.
K_SCALE, V_SCALE = 0.037, 0.021


def _full(base: Op, args: tuple[Any, ...]) -> list[Any]:
    """``args`` with the base op's defaults filled in, up to its last parameter."""
    params = list(base.signature.parameters.values())
    return [*args, *(p.default for p in params[len(args) :])]


def _in_fp8(base: Op, caches: tuple[int, int]) -> Callable[..., list[SampleInput]]:
    """The base op's hand samples with their caches quantised to e4m3 under the sample scales (NaN poison kept,
    views kept views of a wider buffer) and the scales appended."""

    def make(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
        found = []
        for sample in base.hand_samples(dtype, device, gen):
            args = _full(base, sample.args)
            for i, s in zip(caches, (K_SCALE, V_SCALE), strict=True):
                args[i] = _keeping_layout(args[i], quantize_kv(args[i], s))
            found.append(SampleInput(sample.label, (*args, K_SCALE, V_SCALE), sample.large))
        return found

    return make


def _keeping_layout(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in a float8 tensor laid out as ``like`` (a view of a wider buffer stays such a view)."""
    if like.is_contiguous():
        return values.contiguous()
    span = like.untyped_storage().nbytes() // like.element_size()
    buf = torch.full((span,), float("nan"), dtype=FP8_DTYPE, device=like.device)
    view = buf.as_strided(like.shape, like.stride(), like.storage_offset())
    view.copy_(values)
    return view


def _errors_of(base: Op, caches: tuple[int, int], keep: Callable[[str], bool]) -> Callable[..., list[ErrorInput]]:
    """The base op's error inputs (those ``keep`` passes, by label) with e4m3 caches and unit scales."""

    def make(device: torch.device) -> list[ErrorInput]:
        found = []
        for case in base.errors(device):
            if not keep(case.label):
                continue
            args = _full(base, case.args)
            for i in caches:
                if isinstance(args[i], torch.Tensor) and args[i].dtype.is_floating_point:
                    expanded = args[i].dim() == 4 and args[i].stride()[0] == 0  # stays an expanded view
                    cache = args[i][:1] if expanded else args[i]
                    args[i] = cache.to(FP8_DTYPE).expand(args[i].shape) if expanded else cache.to(FP8_DTYPE)
            found.append(ErrorInput(case.label, (*args, 1.0, 1.0), case.match))
        return found

    return make


def _valid_args(base: Op, device: torch.device) -> list[Any]:
    """Small valid arguments of the base op (float caches), for the FP8 ops' own error cases."""
    kc = torch.randn(4, 16, 2, 64, device=device)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([3, 5], dtype=torch.int32, device=device)
    if base is reshape_and_cache:
        k = torch.randn(3, 2, 64, device=device)
        return _full(base, (k, k, kc, kc.clone(), torch.arange(3, device=device)))
    if base is paged_attention:
        return _full(base, (torch.randn(2, 4, 64, device=device), kc, kc, tables, lens, 0.1))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    return _full(base, (torch.randn(8, 4, 64, device=device), kc, kc, tables, cu, lens, 5, 0.1))


def _own_errors(op: str, base: Op, caches: tuple[int, int]) -> Callable[..., list[ErrorInput]]:
    def make(device: torch.device) -> list[ErrorInput]:
        good = _valid_args(base, device)
        args = list(good)
        for i in caches:
            args[i] = args[i].to(FP8_DTYPE)
        float_cache = list(args)
        float_cache[caches[0]] = good[caches[0]]
        return [
            ErrorInput("a float key cache", (*float_cache, 1.0, 1.0), "key_cache must be a torch.float8_e4m3fn"),
            ErrorInput("a zero k_scale", (*args, 0.0, 1.0), "k_scale must be a positive finite float"),
            ErrorInput("an infinite v_scale", (*args, 1.0, math.inf), "v_scale must be a positive finite float"),
        ]

    return make


def _with_scales(values: Callable[..., list[ErrorInput]], caches: tuple[int, int], base: Op):
    def make(device: torch.device) -> list[ErrorInput]:
        found = []
        for case in values(device):
            args = _full(base, case.args)
            for i in caches:
                args[i] = args[i].to(FP8_DTYPE)
            found.append(ErrorInput(case.label, (*args, 1.0, 1.0), case.match))
        return found

    return make


def _structural(label: str) -> bool:
    """Base error cases that stay errors with an FP8 cache (dtype agreement is not asked of an FP8 cache)."""
    return "dtype" not in label and "wrong head size" not in label


def _combined(*factories):
    return lambda device: [case for make in factories for case in make(device)]


def _cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    return None


def _tolerance_of(base: Op) -> dict[torch.dtype, Tolerance]:
    return {dtype: Tolerance(t.atol, t.rtol, f"as {base.name}: {t.reason}") for dtype, t in base.tolerances.items()}


def _against(oracle: Callable[..., Any]) -> Callable[..., str | None]:
    """A checker that is ``Op.check`` with ``oracle`` (the reference without its FP8 checks) in the reference's place:
    ``Op.check`` runs the reference on float64 copies of every float argument, the e4m3 caches included."""

    def check(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
        return dataclasses.replace(op, reference=oracle, checker=None).check(fn, args, dtype)

    return check


def _op(name, reference, oracle, base: Op, caches: tuple[int, int], **kw) -> Op:
    errors = _combined(_own_errors(name, base, caches), _errors_of(base, caches, _structural))
    return Op(
        name=name,
        reference=reference,
        hand_samples=_in_fp8(base, caches),
        errors=errors,
        value_errors=_with_scales(base.value_errors, caches, base),
        variants=base.variants,
        checker=_against(oracle),
        **kw,
    )


reshape_and_cache_fp8 = _op(
    "reshape_and_cache_fp8",
    reshape_and_cache_fp8_reference,
    _write,
    reshape_and_cache,
    (2, 3),
    tolerances={
        dtype: Tolerance(0.0, 0.0, "the write rounds as stated (float32 division, nearest even): bytes equal")
        for dtype in reshape_and_cache.tolerances
    },
    mutates=("key_cache", "value_cache"),
    fake=_cache_fake,
)
paged_attention_fp8 = _op(
    "paged_attention_fp8",
    paged_attention_fp8_reference,
    _decode,
    paged_attention,
    (1, 2),
    tolerances=_tolerance_of(paged_attention),
    fake=lambda query, *_args, **_kw: query.new_empty(query.shape),
    invariant=paged_attention.invariant,
)
prefill_attention_fp8 = _op(
    "prefill_attention_fp8",
    prefill_attention_fp8_reference,
    _prefill,
    prefill_attention,
    (1, 2),
    tolerances=_tolerance_of(prefill_attention),
    fake=lambda query, *_args, **_kw: query.new_empty(query.shape),
    invariant=prefill_attention.invariant,
)
