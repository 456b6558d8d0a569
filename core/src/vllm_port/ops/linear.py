"""Embedding lookup and the linear layer (matrix product with optional bias)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import OpInputError
from ._checks import INDEX_DTYPES, check_float, check_index, check_same, check_values_in, reads_values
from ._op import ErrorInput, IndexedTable, Op, SampleInput, Tolerance, Variants


def check_embedding(input_ids: torch.Tensor, weight: torch.Tensor) -> None:
    """Refuse arguments outside ``embedding``'s contract; ids are checked against the vocabulary under validation."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        got = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise OpInputError(f"embedding: input_ids must be an int32/int64 tensor of token ids, got {got}")
    check_float("embedding", "weight", weight)
    if weight.dim() != 2:
        raise OpInputError(f"embedding: weight has shape {tuple(weight.shape)}; it must be [vocab_size, hidden_size]")
    check_index("embedding", "input_ids", input_ids, None, "weight", weight)
    if reads_values(input_ids):
        vocab = weight.shape[0]
        check_values_in(
            "embedding",
            "input_ids",
            input_ids,
            0,
            vocab,
            f"the vocabulary of weight has {vocab} rows; pass ids the model's tokenizer makes (or a weight with "
            "every id's row)",
        )


def embedding_reference(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of ``weight`` for each id: ``[*input_ids.shape, hidden_size]``, a new contiguous tensor.

    ``weight`` may be a strided view (a slice of a wider table).
    """
    check_embedding(input_ids, weight)
    return weight[input_ids.long()].contiguous()


def check_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Refuse arguments outside ``linear``'s contract."""
    check_float("linear", "x", x)
    check_float("linear", "weight", weight)
    check_same("linear", "weight", weight, "x", x)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise OpInputError(
            f"linear: x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; weight must be "
            "[out_features, in_features] with in_features equal to x's last dimension"
        )
    if bias is not None:
        check_float("linear", "bias", bias)
        check_same("linear", "bias", bias, "x", x)
        if bias.shape != (weight.shape[0],):
            raise OpInputError(
                f"linear: bias has shape {tuple(bias.shape)}; it must be [{weight.shape[0]}] (out_features)"
            )


def packed_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or a contiguous copy where ``x`` is a bfloat16 CPU tensor whose rows are not packed.

    torch's CPU bfloat16 GEMM (2.13, ``F.linear`` and ``matmul``) reads past the end of each row when
    the rows of ``x`` are padded (a row stride above the row length), the length is odd and the output
    is large enough for its blocked path (about 1,400 elements): the element after a row is multiplied
    by zero, so a NaN or Inf in the padding makes outputs NaN and any finite padding goes unseen. Found
    by the fuzz tests (``bfloat16[6, 6, 3]`` with strides ``(24, 4, 1)``: 456 of 1,368 outputs NaN).
    Every provider that hands an activation to torch's GEMM on the host passes it through here first;
    the copy costs a pass over ``x``, only for such views.
    """
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.is_contiguous():
        return x.contiguous()
    return x


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, accumulated in float32 or better, rounded to ``x``'s dtype.

    Every argument may be a strided view: ``weight`` in particular may be the transpose of an
    ``[in_features, out_features]`` tensor. The output is a new contiguous tensor.
    """
    check_linear(x, weight, bias)
    return F.linear(packed_rows(x), weight, bias).contiguous()


def _embedding_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label: str, ids_shape: tuple[int, ...], vocab: int, hidden: int) -> SampleInput:
        ids = torch.randint(0, vocab, ids_shape, generator=gen).to(device)
        return SampleInput(label, (ids, torch.randn(vocab, hidden, generator=gen).to(device, dtype)))

    # the table as a column slice of a wider one (rows 2 * 96 elements apart), looked up by int32 ids
    wide = torch.randn(300, 2 * 96, generator=gen).to(device, dtype)
    ids = torch.randint(0, 300, (11,), generator=gen).to(device, torch.int32)
    return [
        case("small", (9,), 50, 32),
        case("one token", (1,), 1000, 64),
        case("llama3-8b vocabulary, narrow rows", (16,), 128256, 64),
        case("a batch of id rows", (3, 5), 200, 48),
        SampleInput("weight a slice of a wider table, int32 ids", (ids, wide[:, :96])),
    ]


def _linear_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def parts(tokens: int, k: int, n: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x = torch.randn(tokens, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)  # keeps outputs near unit scale
        b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        return x, w, b

    def case(label: str, tokens: int, k: int, n: int, bias: bool) -> SampleInput:
        return SampleInput(label, parts(tokens, k, n, bias))

    x, w, b = parts(5, 256, 384, True)
    transposed = w.t().contiguous().t()  # stored [in_features, out_features], as some checkpoints keep it
    wide_x = torch.randn(6, 3 * 512, generator=gen).to(device, dtype)[:, 512:1024]  # a slice of a wider row
    padded_x = nan_padded_rows(torch.randn(36, 3, generator=gen).to(device, dtype))
    return [
        case("small", 7, 64, 48, False),
        case("small with bias", 7, 64, 48, True),
        case("llama3-8b qkv decode", 4, 4096, 6144, False),
        # one row (a matrix-vector product) over few outputs: a split-K kernel splits this reduction across
        # programs (16 blocks of outputs cannot fill a GPU) and must add every split's partial sums
        case("one row, 8192 in_features to 256 out_features, bias", 1, 8192, 256, True),
        # A long reduction: partial sums kept in 16 bits lose precision here.
        case("in_features 16384 (llama3-405b)", 16, 16384, 512, False),
        # tensor-parallel shards of llama2-7b's 11008-wide MLP: no multiple of 256 (5504) or of 64 (1376)
        case("out_features 5504 (11008 / 2, a tensor-parallel shard), bias", 3, 256, 5504, True),
        case("in_features 1376 (11008 / 8), 65 rows", 65, 1376, 96, False),
        SampleInput("transposed weight (a view)", (x, transposed, b)),
        SampleInput("x a slice of a wider row", (wide_x, parts(1, 512, 96, False)[1], None)),
        # rows of odd length with NaN between them: torch's CPU bfloat16 GEMM reads it (see packed_rows)
        SampleInput("x rows of 3 padded with NaN to 4, 36 x 38 outputs", (padded_x, parts(1, 3, 38, False)[1], None)),
    ]


def nan_padded_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, k]`` copied into a view whose rows are ``k + 1`` apart, NaN in each gap: a read past a row shows."""
    rows, k = x.shape
    padded = torch.full((rows, k + 1), math.nan, dtype=x.dtype, device=x.device)[:, :k]
    return padded.copy_(x)


def _embedding_errors(device: torch.device) -> list[ErrorInput]:
    w = torch.randn(10, 4, device=device)
    return [
        ErrorInput("float ids", (torch.zeros(3, device=device), w), "input_ids must be"),
        ErrorInput("1-D weight", (torch.zeros(3, dtype=torch.long, device=device), w[0]), "vocab_size, hidden_size"),
    ]


def _embedding_value_errors(device: torch.device) -> list[ErrorInput]:
    w = torch.randn(10, 4, device=device)
    return [
        ErrorInput("id equal to the vocabulary size", (torch.tensor([3, 10], device=device), w), "input_ids[1] is 10"),
        ErrorInput("negative id", (torch.tensor([[0, -1]], dtype=torch.int32, device=device), w), "input_ids[0, 1]"),
    ]


def _linear_errors(device: torch.device) -> list[ErrorInput]:
    x, w = torch.randn(2, 8, device=device), torch.randn(4, 8, device=device)
    return [
        ErrorInput("in_features mismatch", (x, torch.randn(4, 7, device=device), None), "in_features"),
        ErrorInput("bias of wrong length", (x, w, torch.randn(5, device=device)), "bias has shape"),
        ErrorInput("mixed dtypes", (x, w.half(), None), "cast them to one dtype"),
    ]


embedding = Op(
    name="embedding",
    reference=embedding_reference,
    tolerances={
        dtype: Tolerance(0.0, 0.0, "a lookup copies rows exactly")
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    },
    hand_samples=_embedding_samples,
    errors=_embedding_errors,
    value_errors=_embedding_value_errors,
    fake=lambda input_ids, weight: weight.new_empty((*input_ids.shape, weight.shape[1])),
    variants=Variants(
        base="small",
        index={"input_ids": INDEX_DTYPES},
        rows=("input_ids",),
        leading=True,
        tables=(IndexedTable("input_ids", ("weight",)),),
    ),
)

linear = Op(
    name="linear",
    reference=linear_reference,
    tolerances={
        torch.float32: Tolerance(1e-4, 1e-4, "float32 sums of 4096 products in another order (blocked, vectorised)"),
        torch.bfloat16: Tolerance(2e-2, 2e-2, "bfloat16 output rounds to 8 significant bits; inputs are exact"),
        torch.float16: Tolerance(2e-3, 2e-3, "float16 output rounds to 11 significant bits; inputs are exact"),
    },
    hand_samples=_linear_samples,
    errors=_linear_errors,
    fake=lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])),
    variants=Variants(base="small with bias", rows=("x",), leading=True),
)
