"""Hypothesis strategies for every contract op: valid inputs within small bounds, and each kind of contract violation.

Valid cases (:func:`valid_cases`) vary what the contract lets vary: shapes (empty batches
included), dtypes, GQA ratios, block sizes, head sizes that are not powers of two, padding
sequences (``seq_lens`` 0, slot -1), stale block-table entries a sequence does not read (in range
or not), and layouts (a view into a wider buffer, a storage offset, transposed storage, the fused
QKV and interleaved-cache views real engines pass). Whatever a provider must not read is poisoned:
the rest of a view's storage and every cache slot no sequence owns hold NaN (an out-of-range index
for integer tensors), so a read past the contract shows as NaN in the output or an ``IndexError``.

Tensor contents come from a ``torch.Generator`` seeded by a drawn integer: Hypothesis shrinks the
shapes and the seed, torch draws the numbers.

Invalid cases (:func:`invalid_cases`) take a valid case and break one rule of its op's contract,
each rule a named *violation*; those that only a look at the values can see are marked
``values=True`` (refused only under ``vllm_port.ops.checks.validation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from vllm_port.ops import ALL_OPS
from vllm_port.ops.fp8 import quantize_fp8_weight
from vllm_port.ops.kv_fp8 import quantize_kv
from vllm_port.ops.rotary import make_cos_sin_cache

NAN = float("nan")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
#: What surrounds an integer view in its storage: an index no tensor of these tests has.
BAD_INDEX = 1 << 20


@dataclass(frozen=True)
class Case:
    """One call of an op: its arguments, the dtype they are checked at, and a label for a violation."""

    op: str
    dtype: torch.dtype
    args: tuple[Any, ...]
    violation: str = ""
    values: bool = False  # the violation shows only in tensor values

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints a failing example with this
        printer.text(repr(self))

    def __repr__(self) -> str:  # shapes, layouts and small index tensors, not every value
        parts = ", ".join(_describe(a) for a in self.args)
        extra = f", violation={self.violation!r}" if self.violation else ""
        return f"Case({self.op}, {str(self.dtype).removeprefix('torch.')}, ({parts}){extra})"


def _describe(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    where = "" if value.device.type == "cpu" else f" on {value.device}"
    layout = "" if value.is_contiguous() else f" strides {value.stride()} offset {value.storage_offset()}"
    text = f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}{layout}{where}"
    if not value.is_floating_point() and value.numel() <= 32 and value.device.type == "cpu":
        text += f"={value.tolist()}"
    return text


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------


def generator(draw: st.DrawFn) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))


def randn(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(shape, generator=g)).to(dtype)


def _fill_for(t: torch.Tensor) -> float | int:
    return NAN if t.is_floating_point() else BAD_INDEX


def layout(
    draw: st.DrawFn, t: torch.Tensor, kinds: tuple[str, ...] = ("plain", "slice", "offset", "transposed")
) -> torch.Tensor:
    """``t``'s values in another memory layout the contract admits, the rest of the storage poisoned.

    ``slice``: a window of a wider last dimension; ``offset``: a storage offset; ``transposed``: the
    last two dimensions stored the other way round (last stride not 1); ``step``: every other element.
    """
    allowed = [k for k in kinds if t.dim() >= (2 if k == "transposed" else 1) or k == "plain"]
    kind = draw(st.sampled_from(allowed))
    fill = _fill_for(t)
    if kind == "slice":
        pad = draw(st.integers(1, 3))
        offset = draw(st.integers(0, pad))
        wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), fill, dtype=t.dtype)
        view = wide[..., offset : offset + t.shape[-1]]
    elif kind == "offset":
        offset = draw(st.integers(1, 5))
        flat = torch.full((t.numel() + offset + 2,), fill, dtype=t.dtype)
        view = flat[offset : offset + t.numel()].view(t.shape)
    elif kind == "transposed":
        view = torch.empty(t.transpose(-1, -2).shape, dtype=t.dtype).transpose(-1, -2)
    elif kind == "step":
        wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), fill, dtype=t.dtype)
        view = wide[..., ::2]
    else:
        return t.clone()
    view.copy_(t)
    return view


def lead_dims(draw: st.DrawFn, max_dims: int = 2, max_size: int = 5) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(0, max_size), min_size=0, max_size=max_dims)))


float_dtypes = st.sampled_from(FLOAT_DTYPES)
int_dtypes = st.sampled_from(INT_DTYPES)


# ------------------------------------------------------------------------------------------------
# Valid inputs, op by op
# ------------------------------------------------------------------------------------------------


@st.composite
def embedding_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    vocab, hidden = draw(st.integers(1, 64)), draw(st.integers(1, 48))
    ids_shape = lead_dims(draw, max_dims=3)
    ids = torch.randint(0, vocab, ids_shape, generator=g).to(draw(int_dtypes))
    weight = layout(draw, randn(g, (vocab, hidden), dtype))
    return Case("embedding", dtype, (layout(draw, ids, ("plain", "slice", "step")), weight))


@st.composite
def rms_norm_case(draw: st.DrawFn, dtype: torch.dtype | None = None, fused: bool = False) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    shape = (*lead_dims(draw), draw(st.integers(1, 300)))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0]))
    epsilon = draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]))
    x = layout(draw, randn(g, shape, dtype, scale))
    weight = layout(draw, (1 + 0.3 * torch.randn(shape[-1], generator=g)).to(dtype), ("plain", "offset", "step"))
    if not fused:
        return Case("rms_norm", dtype, (x, weight, epsilon))
    residual = layout(draw, randn(g, shape, dtype, scale), ("plain", "slice", "offset", "transposed"))
    return Case("fused_add_rms_norm", dtype, (x, residual, weight, epsilon))


@st.composite
def linear_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    k, n = draw(st.integers(1, 96)), draw(st.integers(1, 64))
    shape = (*lead_dims(draw, max_dims=2, max_size=6), k)
    x = layout(draw, randn(g, shape, dtype))
    weight = layout(draw, randn(g, (n, k), dtype, k**-0.5))
    bias = layout(draw, randn(g, (n,), dtype), ("plain", "offset", "step")) if draw(st.booleans()) else None
    return Case("linear", dtype, (x, weight, bias))


GRANULARITIES = ("tensor", "channel", "group")
OPS_BY_NAME = {op.name: op for op in ALL_OPS}


@st.composite
def fp8_linear_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    k, n = draw(st.integers(1, 300)), draw(st.integers(1, 64))
    shape = (*lead_dims(draw, max_dims=2, max_size=6), k)
    x = layout(draw, randn(g, shape, dtype))
    weight, scale = quantize_fp8_weight(randn(g, (n, k), torch.float32, k**-0.5), draw(st.sampled_from(GRANULARITIES)))
    bias = layout(draw, randn(g, (n,), dtype), ("plain", "offset", "step")) if draw(st.booleans()) else None
    return Case("fp8_linear", dtype, (x, layout(draw, weight), scale, bias))


@st.composite
def gated_case(draw: st.DrawFn, op: str, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    shape = (*lead_dims(draw), 2 * draw(st.integers(0, 150)))
    x = layout(draw, randn(g, shape, dtype, draw(st.sampled_from([1.0, 4.0]))))
    if op == "silu_and_mul":
        return Case(op, dtype, (x,))
    return Case(op, dtype, (x, draw(st.sampled_from(["none", "tanh"]))))


@st.composite
def rotary_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    tokens, heads, kv_heads = draw(st.integers(0, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    head_size = draw(st.integers(2, 64))
    rot = 2 * draw(st.integers(1, head_size // 2))
    max_position = draw(st.integers(1, 64))
    positions = torch.randint(0, max_position, (tokens,), generator=g).to(draw(int_dtypes))
    positions = layout(draw, positions, ("plain", "offset", "step"))
    cache = make_cos_sin_cache(max_position, rot, base=draw(st.sampled_from([10.0, 10000.0])))
    cache = layout(draw, cache.to(draw(st.sampled_from([torch.float32, dtype]))), ("plain", "slice", "offset"))
    three_d = draw(st.booleans())
    if draw(st.booleans()):  # query and key as slices of one fused projection [tokens, (heads + 2 kv) * head_size]
        qkv = randn(g, (tokens, (heads + 2 * kv_heads) * head_size), dtype)
        q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    else:
        q = layout(draw, randn(g, (tokens, heads * head_size), dtype), ("plain", "slice", "offset"))
        k = layout(draw, randn(g, (tokens, kv_heads * head_size), dtype), ("plain", "slice", "offset"))
    if three_d:
        q, k = q.unflatten(-1, (heads, head_size)), k.unflatten(-1, (kv_heads, head_size))
    return Case("rotary_embedding", dtype, (positions, q, k, head_size, cache, draw(st.booleans())))


BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 8, 16, 32])


def _caches(draw: st.DrawFn, g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype):
    """Key and value caches of ``shape``: separate, two halves of one interleaved buffer, or a head-size slice."""
    kind = draw(st.sampled_from(["separate", "interleaved", "slice"]))
    if kind == "interleaved":  # [num_blocks, 2, block_size, kv_heads, head_size], as one allocation
        kv = randn(g, (shape[0], 2, *shape[1:]), dtype)
        return kv[:, 0], kv[:, 1]
    if kind == "slice":
        return tuple(layout(draw, randn(g, shape, dtype), ("slice",)) for _ in range(2))
    return randn(g, shape, dtype), randn(g, shape, dtype)


@st.composite
def reshape_and_cache_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    num_blocks, block_size = draw(st.integers(1, 6)), draw(BLOCK_SIZES)
    kv_heads, head_size = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    total = num_blocks * block_size
    real, padding = draw(st.integers(0, min(total, 12))), draw(st.integers(0, 4))
    slots = torch.cat([torch.randperm(total, generator=g)[:real], torch.full((padding,), -1)])
    slots = slots[torch.randperm(real + padding, generator=g)].to(draw(int_dtypes))
    key_cache, value_cache = _caches(draw, g, (num_blocks, block_size, kv_heads, head_size), dtype)
    tokens = real + padding
    if draw(st.booleans()):  # key and value as slices of a fused qkv projection
        qkv = randn(g, (tokens, 4 * kv_heads * head_size), dtype)
        key = qkv[:, 2 * kv_heads * head_size : 3 * kv_heads * head_size].unflatten(-1, (kv_heads, head_size))
        value = qkv[:, 3 * kv_heads * head_size :].unflatten(-1, (kv_heads, head_size))
    else:
        key = layout(draw, randn(g, (tokens, kv_heads, head_size), dtype))
        value = layout(draw, randn(g, (tokens, kv_heads, head_size), dtype))
    slots = layout(draw, slots, ("plain", "offset", "step"))
    return Case("reshape_and_cache", dtype, (key, value, key_cache, value_cache, slots))


def _paged(draw: st.DrawFn, g: torch.Generator, dtype: torch.dtype, seq_lens: list[int], kv_heads: int, head_size: int):
    """Caches whose slots no sequence owns hold NaN, block tables whose unread entries are stale (any value)."""
    block_size = draw(BLOCK_SIZES)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + draw(st.integers(1, 2))
    width = max(need, default=0) + draw(st.integers(0, 2))
    if width == 0 and draw(st.booleans()):
        width = 1
    key_cache, value_cache = _caches(draw, g, (num_blocks, block_size, kv_heads, head_size), dtype)
    order = torch.randperm(num_blocks, generator=g)
    stale = draw(st.sampled_from(["spare", "random", "out of range"]))
    if stale == "spare":  # a block nobody owns (NaN throughout)
        tables = torch.full((len(seq_lens), width), int(order[-1]))
    elif stale == "random":  # blocks other sequences own: a provider reading them mixes sequences
        tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=g)
    else:  # whatever the last batch left: not even a block
        tables = torch.randint(-3, num_blocks + 5, (len(seq_lens), width), generator=g)
        tables = torch.where(tables >= 0, tables + num_blocks, tables)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for i, n in enumerate(seq_lens):
        blocks = order[used : used + need[i]]
        used += need[i]
        tables[i, : need[i]] = blocks
        owned[blocks] = torch.arange(block_size)[None, :] < (n - torch.arange(need[i]) * block_size)[:, None]
    for cache in (key_cache, value_cache):
        cache[~owned] = NAN
    tables = layout(draw, tables.to(draw(int_dtypes)), ("plain", "slice", "offset"))
    lens = layout(draw, torch.tensor(seq_lens, dtype=draw(int_dtypes)), ("plain", "offset", "step"))
    return key_cache, value_cache, tables, lens


def _attention_scalars(draw: st.DrawFn, head_size: int) -> tuple[float, int, float]:
    scale = head_size**-0.5 * draw(st.sampled_from([0.5, 1.0, 2.0]))
    window = draw(st.sampled_from([0, 0, 1, 3, 8, 20]))
    soft_cap = draw(st.sampled_from([0.0, 0.0, 5.0, 30.0]))
    return scale, window, soft_cap


def _query(
    draw: st.DrawFn, g: torch.Generator, dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_size: int
):
    scale = draw(st.sampled_from([1.0, 3.0]))
    if draw(st.booleans()):  # a slice of a fused qkv projection
        qkv = randn(g, (tokens, (heads + 2 * kv_heads) * head_size), dtype, scale)
        return qkv[:, : heads * head_size].unflatten(-1, (heads, head_size))
    return layout(draw, randn(g, (tokens, heads, head_size), dtype, scale))


def _heads(draw: st.DrawFn, max_head_size: int) -> tuple[int, int, int]:
    kv_heads, group = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 3, 4, 8]))
    return kv_heads * group, kv_heads, draw(st.integers(1, max_head_size))


@st.composite
def paged_attention_case(draw: st.DrawFn, dtype: torch.dtype | None = None, max_len: int = 48) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    heads, kv_heads, head_size = _heads(draw, 80)
    seq_lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, max_len)), min_size=0, max_size=5))
    key_cache, value_cache, tables, lens = _paged(draw, g, dtype, seq_lens, kv_heads, head_size)
    query = _query(draw, g, dtype, len(seq_lens), heads, kv_heads, head_size)
    args = (query, key_cache, value_cache, tables, lens, *_attention_scalars(draw, head_size))
    return Case("paged_attention", dtype, args)


@st.composite
def prefill_attention_case(draw: st.DrawFn, dtype: torch.dtype | None = None, max_q: int = 12) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    heads, kv_heads, head_size = _heads(draw, 80)
    num_seqs = draw(st.integers(0, 4))
    q_lens, seq_lens = [], []
    for _ in range(num_seqs):
        if draw(st.integers(0, 4)) == 0:  # a padded sequence: seq_lens 0, maybe owning padding query rows
            q_lens.append(draw(st.integers(0, 3)))
            seq_lens.append(0)
        else:
            q = draw(st.integers(0, max_q))
            q_lens.append(q)
            seq_lens.append(q + draw(st.integers(0 if q else 1, 24)))  # a cached prefix (chunked prefill)
    key_cache, value_cache, tables, lens = _paged(draw, g, dtype, seq_lens, kv_heads, head_size)
    tokens = sum(q_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=draw(int_dtypes))
    cu = layout(draw, cu, ("plain", "offset", "step"))
    query = _query(draw, g, dtype, tokens, heads, kv_heads, head_size)
    max_query_len = max([*q_lens, 1]) + draw(st.integers(0, 2))
    args = (query, key_cache, value_cache, tables, cu, lens, max_query_len, *_attention_scalars(draw, head_size))
    return Case("prefill_attention", dtype, args)


@st.composite
def sample_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    rows, vocab = draw(st.integers(0, 8)), draw(st.integers(1, 300))
    logits = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.3, 1.0, 5.0]))
    if draw(st.booleans()):  # whole numbers: ties at the maximum and at the k-th score
        logits = logits.round()
    if draw(st.booleans()) and vocab > 1:  # masked tokens (a logit bias of -inf), never the whole row
        masked = torch.rand(rows, vocab, generator=g) < 0.3
        masked[:, 0] = False
        logits = logits.masked_fill(masked, float("-inf"))
    temperature = torch.tensor(
        draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.7, 1.0, 1.5, 4.0]), min_size=rows, max_size=rows)),
        dtype=torch.float32,
    )
    top_k = torch.tensor(
        draw(st.lists(st.integers(-1, vocab + 3), min_size=rows, max_size=rows)), dtype=draw(int_dtypes)
    )
    top_p = torch.tensor(
        draw(st.lists(st.sampled_from([1e-6, 0.1, 0.5, 0.9, 0.99, 1.0]), min_size=rows, max_size=rows)),
        dtype=torch.float32,
    )
    # None: the caller says no row truncates by it (what the engine passes for SamplingParams' defaults)
    top_k = None if draw(st.integers(0, 3)) == 0 else top_k
    top_p = None if draw(st.integers(0, 3)) == 0 else top_p
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g, dtype=torch.int64)
    kinds = ("plain", "offset", "step")
    rest = (None if t is None else layout(draw, t, kinds) for t in (temperature, top_k, top_p, seeds))
    args = (layout(draw, logits.to(dtype)), *rest)
    return Case("sample", dtype, args)


@st.composite
def process_logits_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    rows, vocab = draw(st.integers(0, 8)), draw(st.integers(1, 300))
    logits = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.3, 1.0, 5.0]))
    bias = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.0, 1.0, 50.0]))
    if draw(st.booleans()):  # bans
        bias = bias.masked_fill(torch.rand(rows, vocab, generator=g) < 0.3, float("-inf"))
    counts = torch.randint(0, 4, (rows, vocab), generator=g, dtype=torch.int32) * (
        torch.rand(rows, vocab, generator=g) < 0.2
    )
    prompt = torch.rand(rows, vocab, generator=g) < 0.2

    def per_row(values: list[float]) -> torch.Tensor:
        return torch.tensor(draw(st.lists(st.sampled_from(values), min_size=rows, max_size=rows)), dtype=torch.float32)

    params = (
        per_row([1.0, 0.5, 1.2, 2.0]),
        per_row([0.0, -2.0, 0.5, 2.0]),
        per_row([0.0, -1.0, 0.3, 2.0]),
        per_row([0.0, 0.3, 1.0, 1.5]),
        per_row([0.0, 0.05, 0.5, 1.0]),
    )
    kinds = ("plain", "offset", "step")
    args = (
        layout(draw, logits.to(dtype)),
        layout(draw, bias),
        layout(draw, counts.to(torch.int32)),
        layout(draw, prompt),
        *(layout(draw, t, kinds) for t in params),
    )
    return Case("process_logits", dtype, args)


@st.composite
def top_logprobs_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    rows, vocab = draw(st.integers(0, 8)), draw(st.integers(1, 300))
    logits = torch.randn(rows, vocab, generator=g) * draw(st.sampled_from([0.3, 1.0, 5.0]))
    if draw(st.booleans()):
        logits = logits.round()
    ids = torch.randint(0, vocab, (rows,), generator=g).to(draw(int_dtypes))
    num_top = draw(st.integers(0, min(vocab, 20)))
    return Case(
        "top_logprobs", dtype, (layout(draw, logits.to(dtype)), layout(draw, ids, ("plain", "offset", "step")), num_top)
    )


@st.composite
def fused_moe_case(draw: st.DrawFn, dtype: torch.dtype | None = None) -> Case:
    g, dtype = generator(draw), dtype or draw(float_dtypes)
    tokens, hidden, inter = draw(st.integers(0, 6)), draw(st.integers(1, 24)), draw(st.integers(1, 12))
    experts = draw(st.integers(1, 10))
    top_k = draw(st.integers(1, experts))
    x = layout(draw, randn(g, (tokens, hidden), dtype))
    logits = layout(draw, randn(g, (tokens, experts), draw(st.sampled_from([dtype, torch.float32])), 2.0))
    w13 = layout(draw, randn(g, (experts, 2 * inter, hidden), dtype, hidden**-0.5))
    w2 = layout(draw, randn(g, (experts, hidden, inter), dtype, inter**-0.5))
    shared = draw(st.integers(0, 8))
    s13 = layout(draw, randn(g, (2 * shared, hidden), dtype, hidden**-0.5)) if shared else None
    s2 = layout(draw, randn(g, (hidden, shared), dtype, shared**-0.5)) if shared else None
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    activation = draw(st.sampled_from(["silu", "gelu", "gelu_tanh"]))
    scaling = draw(st.sampled_from([1.0, 2.5, 16.0]))
    args = (x, logits, w13, w2, top_k, scoring, draw(st.booleans()), activation, scaling, s13, s2)
    return Case("fused_moe", dtype, args)


#: op name -> strategy of valid cases, for any dtype (or the one given)
#: The FP8 cache ops: their float op, and where its caches are among the arguments.
FP8_CACHE_OPS = {
    "reshape_and_cache_fp8": ("reshape_and_cache", (2, 3)),
    "paged_attention_fp8": ("paged_attention", (1, 2)),
    "prefill_attention_fp8": ("prefill_attention", (1, 2)),
}


def _fp8_cache_case(op: str) -> Callable[..., st.SearchStrategy[Case]]:
    """Cases of an FP8 cache op: its float op's, the caches in e4m3 under drawn scales (NaN poison kept)."""
    base, caches = FP8_CACHE_OPS[op]

    @st.composite
    def case(draw: st.DrawFn, dtype: torch.dtype | None = None, **limits: Any) -> Case:
        c = draw(VALID[base](dtype, **limits))
        params = list(OPS_BY_NAME[base].signature.parameters.values())
        args = [*c.args, *(p.default for p in params[len(c.args) :])]
        scales = [draw(st.sampled_from([1.0, 0.05, 3.0])) for _ in caches]
        for i, scale in zip(caches, scales, strict=True):
            args[i] = quantize_kv(args[i], scale)
        return Case(op, c.dtype, (*args, *scales))

    return case


def _fp8_cache_violations(op: str) -> list[Violation]:
    """The float op's violations that still break the FP8 op (not a dtype that no longer has to match), and its own."""
    base, caches = FP8_CACHE_OPS[op]
    inputs = [i for i in range(3) if i not in caches]  # query, or key and value
    kept = [v for v in VIOLATIONS[base] if not any(v[0] == f"arg {i} of another float dtype" for i in inputs)]
    n = len(OPS_BY_NAME[base].signature.parameters)
    return [
        *kept,
        _set(caches[0], lambda c: c.to(torch.bfloat16), "a bfloat16 key cache"),
        _set(n, lambda s: 0.0, "a zero k_scale"),
        _set(n + 1, lambda s: float("nan"), "a NaN v_scale"),
    ]


VALID: dict[str, Callable[..., st.SearchStrategy[Case]]] = {
    "embedding": embedding_case,
    "rms_norm": rms_norm_case,
    "fused_add_rms_norm": lambda dtype=None: rms_norm_case(dtype, fused=True),
    "linear": linear_case,
    "fp8_linear": fp8_linear_case,
    "rotary_embedding": rotary_case,
    "reshape_and_cache": reshape_and_cache_case,
    "prefill_attention": prefill_attention_case,
    "paged_attention": paged_attention_case,
    "silu_and_mul": lambda dtype=None: gated_case("silu_and_mul", dtype),
    "gelu_and_mul": lambda dtype=None: gated_case("gelu_and_mul", dtype),
    "fused_moe": fused_moe_case,
    "sample": sample_case,
    "process_logits": process_logits_case,
    "top_logprobs": top_logprobs_case,
}
VALID.update({op: _fp8_cache_case(op) for op in FP8_CACHE_OPS})


def valid_cases(op: str, **limits: Any) -> st.SearchStrategy[Case]:
    """Valid cases of ``op``; ``limits`` narrow the attention ops' sizes (``max_len``, ``max_q``) for slow providers."""
    return VALID[op](**limits)


# ------------------------------------------------------------------------------------------------
# Violations: each takes a valid case's arguments (a list to edit) and breaks one rule
# ------------------------------------------------------------------------------------------------

Args = list[Any]
#: (name, applies to these args?, break them; values: only a look at the values shows it)
Violation = tuple[str, Callable[[Args], bool], Callable[[st.DrawFn, Args], None], bool]


def _always(_: Args) -> bool:
    return True


def _on_meta(i: int) -> Violation:
    """Argument ``i`` on another device (``meta``: every machine has it) than the rest."""
    return (
        f"arg {i} on another device",
        lambda a: isinstance(a[i], torch.Tensor),
        lambda d, a: a.__setitem__(i, a[i].to("meta")),
        False,
    )


def _set(i: int, make: Callable[[Any], Any], name: str, when: Callable[[Args], bool] = _always) -> Violation:
    return (name, when, lambda d, a: a.__setitem__(i, make(a[i])), False)


def _to_dtype(i: int, dtype: torch.dtype, name: str) -> Violation:
    return _set(i, lambda t: t.to(dtype), name, lambda a: isinstance(a[i], torch.Tensor) and a[i].dtype != dtype)


def _other_float(i: int) -> Violation:
    """Argument ``i`` in another float dtype than the one it must share."""

    def apply(draw: st.DrawFn, a: Args) -> None:
        a[i] = a[i].to(draw(st.sampled_from([d for d in FLOAT_DTYPES if d != a[i].dtype])))

    return (f"arg {i} of another float dtype", lambda a: isinstance(a[i], torch.Tensor), apply, False)


def _not_tensor(i: int) -> Violation:
    return _set(i, lambda t: t.tolist(), f"arg {i} a list, not a tensor", lambda a: isinstance(a[i], torch.Tensor))


def _rank(i: int, name: str = "") -> Violation:
    extra = name or f"arg {i} with an extra dimension"
    return _set(i, lambda t: t.unsqueeze(0), extra, lambda a: isinstance(a[i], torch.Tensor))


def _expanded(i: int) -> Violation:
    """An in-place argument as an expanded view of its first row: one write would land in several elements."""

    def when(a: Args) -> bool:  # an empty tensor is written nowhere, expanded or not
        return a[i].dim() >= 1 and a[i].shape[0] > 1 and a[i].numel() > 0

    return _set(i, lambda t: t[:1].expand(t.shape), f"arg {i} an expanded view", when)


def _resize(i: int, dim: int, delta: int, name: str) -> Violation:
    def apply(draw: st.DrawFn, a: Args) -> None:
        t = a[i]
        size = t.shape[dim] + delta
        shape = list(t.shape)
        shape[dim] = size
        a[i] = torch.zeros(shape, dtype=t.dtype) if not t.is_floating_point() else torch.randn(shape).to(t.dtype)

    return (name, lambda a: a[i].dim() > (dim if dim >= 0 else -dim - 1) and a[i].shape[dim] + delta >= 0, apply, False)


def _scalar(i: int, values: list[Any], name: str) -> Violation:
    return (name, _always, lambda d, a: a.__setitem__(i, d(st.sampled_from(values))), False)


def _value(name: str, when: Callable[[Args], bool], apply: Callable[[st.DrawFn, Args], None]) -> Violation:
    return (name, when, apply, True)


def _poke(i: int, pick: Callable[[st.DrawFn, Args], tuple[tuple[int, ...], int]]) -> Callable[[st.DrawFn, Args], None]:
    """Set one element of index tensor ``i`` (a contiguous copy) to a value ``pick`` chooses."""

    def apply(draw: st.DrawFn, a: Args) -> None:
        at, value = pick(draw, a)
        t = a[i].clone()
        t[at] = value
        a[i] = t

    return apply


def _any_index(draw: st.DrawFn, t: torch.Tensor) -> tuple[int, ...]:
    return tuple(draw(st.integers(0, s - 1)) for s in t.shape)


def _out_of(draw: st.DrawFn, low: int, high: int) -> int:
    """A value outside ``[low, high)``, near an edge or far."""
    return draw(st.sampled_from([low - 1, low - 100, high, high + 1, high + 10_000]))


def _cache_shape_zero(i: int) -> Violation:
    """A cache with an empty dimension (no block, a block of 0 tokens, 0 KV heads or a head size of 0)."""

    def apply(draw: st.DrawFn, a: Args) -> None:
        dim = draw(st.integers(0, 3))
        shape = list(a[i].shape)
        shape[dim] = 0
        a[i] = a[i].new_zeros(shape)
        a[i + 1] = a[i + 1].new_zeros(shape)

    return ("a cache dimension of 0", _always, apply, False)


def _norm_violations(fused: bool) -> list[Violation]:
    w = 2 if fused else 1
    found = [
        _to_dtype(0, torch.int32, "integer x"),
        _other_float(w),
        _on_meta(w),
        _not_tensor(0),
        _resize(w, 0, 1, "weight one longer"),
        _rank(w, "2-D weight"),
        _scalar(w + 1, [-1e-6, float("nan"), float("inf"), None, "1e-6", True], "bad epsilon"),
    ]
    if fused:
        found += [_other_float(1), _on_meta(1), _resize(1, 0, 1, "residual of another shape"), _expanded(1)]
    return found


def _gated_violations(gelu: bool) -> list[Violation]:
    found = [
        _to_dtype(0, torch.int64, "integer x"),
        _not_tensor(0),
        _resize(0, -1, 1, "odd last dimension"),
        _set(0, lambda t: t.new_zeros(()), "0-dim x"),
    ]
    if gelu:
        found.append(_scalar(1, ["fast", "", None, "Tanh"], "unknown approximation"))
    return found


def _embedding_violations() -> list[Violation]:
    def bad_id(draw: st.DrawFn, a: Args) -> tuple[tuple[int, ...], int]:
        return _any_index(draw, a[0]), _out_of(draw, 0, a[1].shape[0])

    return [
        _to_dtype(0, torch.float32, "float ids"),
        _to_dtype(0, torch.int16, "int16 ids"),
        _to_dtype(1, torch.int64, "integer weight"),
        _on_meta(0),
        _not_tensor(0),
        _rank(1, "3-D weight"),
        _set(1, lambda t: t[0], "1-D weight"),
        _value("id outside the vocabulary", lambda a: a[0].numel() > 0, _poke(0, bad_id)),
    ]


def _linear_violations() -> list[Violation]:
    def has_bias(a: Args) -> bool:
        return a[2] is not None

    return [
        _to_dtype(0, torch.int32, "integer x"),
        _other_float(1),
        _on_meta(1),
        _not_tensor(1),
        _resize(1, 1, 1, "in_features one more"),
        _rank(1, "3-D weight"),
        _set(2, lambda b: torch.zeros(1), "bias of one element", lambda a: a[1].shape[0] != 1),
        ("bias of another dtype", has_bias, lambda d, a: a.__setitem__(2, a[2].to(torch.float64)), False),
        ("bias on another device", has_bias, lambda d, a: a.__setitem__(2, a[2].to("meta")), False),
        ("2-D bias", has_bias, lambda d, a: a.__setitem__(2, a[2][None]), False),
    ]


def _fp8_linear_violations() -> list[Violation]:
    def has_bias(a: Args) -> bool:
        return a[3] is not None

    def zero_scale(draw: st.DrawFn, a: Args) -> None:
        scale = a[2].clone()
        scale.view(-1)[draw(st.integers(0, scale.numel() - 1))] = 0.0
        a[2] = scale

    return [
        _to_dtype(0, torch.int32, "integer x"),
        _to_dtype(1, torch.bfloat16, "a float weight"),
        _to_dtype(1, torch.float8_e5m2, "an e5m2 weight"),
        _resize(1, 1, 1, "in_features one more"),
        _rank(1, "3-D weight"),
        _to_dtype(2, torch.bfloat16, "a bfloat16 scale"),
        _set(2, lambda s: s.reshape(1, 1, -1), "a 3-D scale"),
        ("bias of another dtype", has_bias, lambda d, a: a.__setitem__(3, a[3].to(torch.float64)), False),
        ("2-D bias", has_bias, lambda d, a: a.__setitem__(3, a[3][None]), False),
        _value("a zero scale", _always, zero_scale),
    ]


def _rotary_violations() -> list[Violation]:
    def bad_position(draw: st.DrawFn, a: Args) -> tuple[tuple[int, ...], int]:
        return _any_index(draw, a[0]), _out_of(draw, 0, a[4].shape[0])

    def head_size_off_applies(a: Args) -> bool:  # 3-D: any other head size; 2-D: one that does not divide
        return a[1].dim() == 3 or a[1].shape[-1] % (a[3] + 1) != 0 or a[2].shape[-1] % (a[3] + 1) != 0

    def head_size_off(draw: st.DrawFn, a: Args) -> None:
        a[3] += 1

    def rot_above(draw: st.DrawFn, a: Args) -> None:
        a[4] = torch.zeros(a[4].shape[0], 2 * (a[3] // 2 + 1))

    return [
        _to_dtype(0, torch.float32, "float positions"),
        _rank(0, "2-D positions"),
        _resize(0, 0, 1, "one position too many"),
        _on_meta(0),
        _on_meta(4),
        _other_float(2),
        _to_dtype(4, torch.int64, "integer cos_sin_cache"),
        _not_tensor(1),
        ("head_size off query's", head_size_off_applies, head_size_off, False),
        _scalar(3, [0, -64, 64.0, True, None], "head_size not a positive int"),
        ("rotary_dim above head_size", _always, rot_above, False),
        _set(4, lambda c: torch.cat([c, c[:, :1]], dim=1), "odd rotary_dim"),
        _set(4, lambda c: c[:0], "cos_sin_cache of no position"),
        _scalar(5, [1, 0, None, "neox"], "is_neox not a bool"),
        _expanded(1),
        _expanded(2),
        _value("position outside the cache", lambda a: a[0].numel() > 0, _poke(0, bad_position)),
    ]


def _cache_violations() -> list[Violation]:
    def bad_slot(draw: st.DrawFn, a: Args) -> tuple[tuple[int, ...], int]:
        total = a[2].shape[0] * a[2].shape[1]
        return _any_index(draw, a[4]), draw(st.sampled_from([-2, -100, total, total + 1, total + 10_000]))

    def duplicate(draw: st.DrawFn, a: Args) -> None:
        kept = (a[4] >= 0).nonzero().flatten().tolist()
        first, second = draw(st.sampled_from(kept)), draw(st.sampled_from([i for i in range(a[4].shape[0])]))
        if first == second:
            second = next(i for i in range(a[4].shape[0]) if i != first)
        t = a[4].clone()
        t[second] = t[first]
        a[4] = t

    return [
        _other_float(0),
        _other_float(2),
        _on_meta(4),
        _on_meta(0),
        _to_dtype(4, torch.float32, "float slots"),
        _rank(4, "2-D slot_mapping"),
        _resize(4, 0, 1, "one slot too many"),
        _resize(0, 2, 1, "key of another head size"),
        _resize(1, 1, 1, "value of more heads"),
        _set(
            3,
            lambda c: c[..., :1] if c.shape[-1] > 1 else c.new_zeros((*c.shape[:-1], 2)),
            "value_cache of another shape",
        ),
        _set(2, lambda c: c[0], "3-D key_cache"),
        _cache_shape_zero(2),
        _expanded(2),
        _expanded(3),
        _value("slot outside the cache", lambda a: a[4].numel() > 0, _poke(4, bad_slot)),
        _value("two tokens, one slot", lambda a: bool((a[4] >= 0).sum() >= 1) and a[4].shape[0] >= 2, duplicate),
    ]


def _attention_violations(prefill: bool) -> list[Violation]:
    lens_at, tables_at = (5, 3) if prefill else (4, 3)
    scale_at = 7 if prefill else 5

    def capacity(a: Args) -> int:
        return a[tables_at].shape[1] * a[1].shape[1]

    def long_seq(draw: st.DrawFn, a: Args) -> tuple[tuple[int, ...], int]:
        return _any_index(draw, a[lens_at]), draw(st.sampled_from([-1, -50, capacity(a) + 1, capacity(a) + 1000]))

    def read_entry(a: Args) -> bool:
        return bool((a[lens_at] > 0).any())

    def bad_block(draw: st.DrawFn, a: Args) -> tuple[tuple[int, ...], int]:
        seq = draw(st.sampled_from((a[lens_at] > 0).nonzero().flatten().tolist()))
        blocks = -(-int(a[lens_at][seq]) // a[1].shape[1])
        return (seq, draw(st.integers(0, blocks - 1))), _out_of(draw, 0, a[1].shape[0])

    found = [
        _other_float(0),
        _other_float(2),
        _on_meta(tables_at),
        _on_meta(lens_at),
        _on_meta(1),
        _to_dtype(tables_at, torch.float32, "float block_tables"),
        _to_dtype(lens_at, torch.int16, "int16 seq_lens"),
        _rank(lens_at, "2-D seq_lens"),
        _resize(lens_at, 0, 1, "one seq_lens entry too many"),
        _resize(tables_at, 0, 1, "one block_tables row too many"),
        _resize(0, 2, 1, "query head size off the cache's"),
        _set(0, lambda q: q[:, :0], "query of no head"),
        (
            "heads not a multiple of KV heads",
            lambda a: a[1].shape[2] > 1,
            lambda d, a: a.__setitem__(0, a[0][:, :1]),
            False,
        ),
        _set(1, lambda c: c[..., :1, :], "key_cache of other KV heads", lambda a: a[1].shape[2] > 1),
        _cache_shape_zero(1),
        _not_tensor(0),
        _scalar(scale_at, [0.0, -0.1, float("nan"), float("inf"), None, True], "bad scale"),
        _scalar(scale_at + 1, [-1, 2.5, None, True], "bad sliding_window"),
        _scalar(scale_at + 2, [-1.0, float("nan"), float("inf"), None], "bad soft_cap"),
        _value("seq_lens outside the block table", lambda a: a[lens_at].numel() > 0, _poke(lens_at, long_seq)),
        _value("a read block_tables entry outside the cache", read_entry, _poke(tables_at, bad_block)),
    ]
    if prefill:

        def bad_offsets(draw: st.DrawFn, a: Args) -> None:
            cu = a[4].clone()
            kind = draw(st.sampled_from(["start", "decrease", "past query", "short of query"]))
            if kind == "start":
                cu[0] = draw(st.sampled_from([-1, 1, 5]))
            elif kind == "decrease" and cu.shape[0] > 2:
                i = draw(st.integers(1, cu.shape[0] - 2))
                cu[i] = cu[i + 1] + draw(st.integers(1, 3))
            elif kind == "short of query":  # rows past the last sequence's queries
                a[0] = torch.cat([a[0], a[0].new_zeros((draw(st.integers(1, 3)), *a[0].shape[1:]))])
            else:
                cu[-1] = a[0].shape[0] + draw(st.integers(1, 3))
            a[4] = cu

        def short_max(a: Args) -> bool:
            q_lens = a[4][1:] - a[4][:-1]
            return q_lens.numel() > 0 and int(q_lens.max()) >= 2

        found += [
            _on_meta(4),
            _to_dtype(4, torch.float64, "float64 cu_seqlens_q"),
            _resize(4, 0, -1, "cu_seqlens_q one short"),
            _scalar(6, [0, -3, 2.0, None, True], "max_query_len not a positive int"),
            _value("cu_seqlens_q not running totals from 0", _always, bad_offsets),
            _value(
                "max_query_len below a query length",
                short_max,
                lambda d, a: a.__setitem__(6, int((a[4][1:] - a[4][:-1]).max()) - 1),
            ),
            _value("more query tokens than cached", lambda a: bool(((a[4][1:] - a[4][:-1]) > 0).any()), _fewer_cached),
        ]
    return found


def _fewer_cached(draw: st.DrawFn, a: Args) -> None:
    """A sequence with query tokens but a (nonzero) length below their count."""
    q_lens = a[4][1:] - a[4][:-1]
    seq = draw(st.sampled_from((q_lens > 0).nonzero().flatten().tolist()))
    if int(q_lens[seq]) < 2:  # one query token: no shorter nonzero length; give it two, past the query
        a[4] = a[4].clone()
        a[4][seq + 1 :] += 1
        a[0] = torch.cat([a[0], a[0][:1]])
        q_lens = a[4][1:] - a[4][:-1]
        a[6] = max(a[6], int(q_lens.max()))
    lens = a[5].clone()
    lens[seq] = draw(st.integers(1, int(q_lens[seq]) - 1))
    a[5] = lens


def _sample_violations() -> list[Violation]:
    def rows(a: Args) -> bool:
        return a[0].shape[0] > 0

    def bad_param(i: int, values: list[float]) -> Callable[[st.DrawFn, Args], None]:
        def apply(draw: st.DrawFn, a: Args) -> None:
            t = a[i].clone()
            t[draw(st.integers(0, t.shape[0] - 1))] = draw(st.sampled_from(values))
            a[i] = t

        return apply

    def nan_logit(draw: st.DrawFn, a: Args) -> None:
        t = a[0].clone()
        t[_any_index(draw, t)] = NAN
        a[0] = t

    return [
        _to_dtype(0, torch.int64, "integer logits"),
        _rank(0, "3-D logits"),
        _set(0, lambda t: t[:, :0], "vocab_size 0"),
        _to_dtype(1, torch.float64, "float64 temperature"),
        _to_dtype(2, torch.float32, "float top_k"),
        _to_dtype(3, torch.bfloat16, "bfloat16 top_p"),
        _to_dtype(4, torch.int32, "int32 seeds"),
        _resize(1, 0, 1, "one temperature too many"),
        _resize(
            4,
            0,
            -1,
            "one seed short",
        ),
        _rank(3, "2-D top_p"),
        _on_meta(1),
        _on_meta(4),
        _not_tensor(2),
        _value("temperature negative or not finite", rows, bad_param(1, [-0.5, -1e-6, NAN, float("inf")])),
        _value("top_p outside (0, 1]", lambda a: rows(a) and a[3] is not None, bad_param(3, [0.0, -0.5, 1.5, NAN])),
        _value("a NaN logit", lambda a: a[0].numel() > 0, nan_logit),
    ]


def _process_logits_violations() -> list[Violation]:
    def rows(a: Args) -> bool:
        return a[0].shape[0] > 0

    def bad(i: int, values: list[Any]) -> Callable[[st.DrawFn, Args], None]:
        def apply(draw: st.DrawFn, a: Args) -> None:
            t = a[i].clone()
            t[_any_index(draw, t)] = draw(st.sampled_from(values))
            a[i] = t

        return apply

    return [
        _to_dtype(0, torch.int64, "integer logits"),
        _rank(0, "3-D logits"),
        _to_dtype(1, torch.bfloat16, "bfloat16 bias"),
        _to_dtype(2, torch.int64, "int64 counts"),
        _to_dtype(3, torch.float32, "float prompt mask"),
        _to_dtype(4, torch.float64, "float64 repetition"),
        _resize(8, 0, 1, "one min_p too many"),
        _resize(1, 1, 1, "a bias column too many"),
        _on_meta(2),
        _not_tensor(6),
        _value("repetition 0 or not finite", rows, bad(4, [0.0, -1.0, NAN, float("inf")])),
        _value("min_p outside [0, 1]", rows, bad(8, [-0.1, 1.5, NAN])),
        _value("bias NaN or +inf", rows, bad(1, [NAN, float("inf")])),
        _value("a negative count", rows, bad(2, [-1, -7])),
        _value("a NaN logit", rows, bad(0, [NAN])),
    ]


def _top_logprobs_violations() -> list[Violation]:
    def rows(a: Args) -> bool:
        return a[0].shape[0] > 0

    def outside(draw: st.DrawFn, a: Args) -> None:
        t = a[1].clone()
        t[_any_index(draw, t)] = draw(st.sampled_from([-1, -100, a[0].shape[1], a[0].shape[1] + 7]))
        a[1] = t

    return [
        _to_dtype(0, torch.int64, "integer logits"),
        _rank(0, "3-D logits"),
        _to_dtype(1, torch.float32, "float token ids"),
        _resize(1, 0, 1, "one token id too many"),
        _on_meta(1),
        _scalar(2, [-1, -5, 10_000, 1.5, None], "num_top negative, past the vocabulary or not an int"),
        _value("a token id outside the vocabulary", rows, outside),
    ]


def _fused_moe_violations() -> list[Violation]:
    def shared(a: Args) -> bool:
        return a[9] is not None

    def nan_logit(draw: st.DrawFn, a: Args) -> None:
        t = a[1].clone()
        t[_any_index(draw, t)] = NAN
        a[1] = t

    def wider(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t.shape[0], t.shape[1] + 1, dtype=t.dtype)

    return [
        _to_dtype(0, torch.int64, "integer x"),
        _rank(0, "3-D x"),
        _resize(1, 0, 1, "router logits of one more token"),
        _set(1, lambda t: t[:, :0], "router logits of no expert"),
        _resize(2, 1, 1, "w13 of odd width"),
        _resize(2, 2, 1, "w13 of another hidden size"),
        _resize(3, 2, 1, "w2 of another intermediate"),
        _resize(3, 0, 1, "w2 of one more expert"),
        _other_float(2),
        _on_meta(1),
        _on_meta(3),
        _not_tensor(2),
        _scalar(4, [0, -1, 1000, True, None, 2.0], "top_k outside [1, num_experts]"),
        _scalar(5, ["Softmax", "relu", None], "unknown scoring"),
        _scalar(6, [1, None, "yes"], "renormalize not a bool"),
        _scalar(7, ["relu", "swiglu", None], "unknown activation"),
        _scalar(8, [0.0, -1.0, NAN, float("inf"), None, True], "routed_scaling not finite and > 0"),
        _set(10, lambda t: None, "shared_w13 without shared_w2", shared),
        _set(10, wider, "shared_w2 of another width", shared),
        _other_float(9),
        _value("a NaN router logit", lambda a: a[1].numel() > 0, nan_logit),
    ]


#: op name -> every way its contract can be broken
VIOLATIONS: dict[str, list[Violation]] = {
    "embedding": _embedding_violations(),
    "rms_norm": _norm_violations(fused=False),
    "fused_add_rms_norm": _norm_violations(fused=True),
    "linear": _linear_violations(),
    "fp8_linear": _fp8_linear_violations(),
    "rotary_embedding": _rotary_violations(),
    "reshape_and_cache": _cache_violations(),
    "prefill_attention": _attention_violations(prefill=True),
    "paged_attention": _attention_violations(prefill=False),
    "silu_and_mul": _gated_violations(gelu=False),
    "gelu_and_mul": _gated_violations(gelu=True),
    "fused_moe": _fused_moe_violations(),
    "sample": _sample_violations(),
    "process_logits": _process_logits_violations(),
    "top_logprobs": _top_logprobs_violations(),
}
VIOLATIONS.update({op: _fp8_cache_violations(op) for op in FP8_CACHE_OPS})


@st.composite
def invalid_cases(draw: st.DrawFn, op: str) -> Case:
    """A valid case of ``op`` with one rule of its contract broken (the violation is in ``Case.violation``)."""
    case = draw(valid_cases(op))
    args = list(case.args)
    applicable = [v for v in VIOLATIONS[op] if v[1](args)]
    name, _, apply, values = draw(st.sampled_from(applicable))
    apply(draw, args)
    return Case(op, case.dtype, tuple(args), name, values)
