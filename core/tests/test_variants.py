"""Sample variants generated from each op's declared arguments (``vllm_port.ops._variants``).

Each class the contract allows is reached: index arguments in every allowed dtype as views of one
buffer at non-zero offsets, float tensors at storage offsets, row counts past 64/128/256 and one
row, leading dimensions, the last row of every indexed table; and the reference accepts every
variant under validation (a variant is a valid input, not an error case).
"""

from __future__ import annotations

import pytest
import torch

from vllm_port.ops import ALL_OPS, IndexedTable, Op, SampleInput, Tolerance, Variants
from vllm_port.ops.checks import validation

CPU = torch.device("cpu")
DECLARED = [op for op in ALL_OPS if op.variants is not None]


def _variants(op: Op, dtype: torch.dtype = torch.float32) -> dict[str, SampleInput]:
    base = op.variants.base
    samples = op.samples(dtype, CPU, torch.Generator().manual_seed(0))
    return {s.label.removeprefix(f"{base}: "): s for s in samples if s.label.startswith(f"{base}: ")}


def _args(op: Op, sample: SampleInput) -> dict:
    return dict(zip(op.signature.parameters, sample.args, strict=False))


def test_every_op_declares_its_variants():
    assert [op.name for op in ALL_OPS if op.variants is None] == []


@pytest.mark.parametrize("op", DECLARED, ids=lambda op: op.name)
def test_the_reference_accepts_every_variant_under_validation(op):
    for sample in _variants(op).values():
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in sample.args)
        with validation():
            op.reference(*args)


@pytest.mark.parametrize("op", [op for op in DECLARED if op.variants.index], ids=lambda op: op.name)
def test_index_arguments_in_each_allowed_dtype_as_offset_views_of_one_buffer(op):
    found = _variants(op)
    for dtype in (torch.int32, torch.int64):
        label = f"{str(dtype).removeprefix('torch.')} index views of one buffer, every tensor at a storage offset"
        args = _args(op, found[label])
        for name, allowed in op.variants.index.items():
            t = args[name]
            assert t.dtype == (dtype if dtype in allowed else t.dtype)
            assert t.storage_offset() > 0, name
        same = {args[n].untyped_storage().data_ptr() for n, a in op.variants.index.items() if dtype in a}
        assert len(same) == 1  # one upload, sliced
        floats = [a for a in args.values() if isinstance(a, torch.Tensor) and a.is_floating_point()]
        assert floats and all(a.storage_offset() > 0 for a in floats)


@pytest.mark.slow
@pytest.mark.parametrize("op", [op for op in DECLARED if op.variants.rows], ids=lambda op: op.name)
def test_row_counts_past_each_tile_and_one_row(op):
    found = _variants(op)
    for n in (1, 65, 129, 257):
        args = _args(op, found[f"{n} row{'s' * (n != 1)}"])
        assert {args[name].shape[0] for name in op.variants.rows} == {n}
    assert found["257 rows"].large and not found["65 rows"].large
    if op.variants.leading:
        spread = _args(op, found["65 rows as 5 x 13 leading dimensions"])
        assert all(spread[name].shape[:2] == (5, 13) for name in op.variants.rows)
        one = _args(op, found["one row without a row dimension"])
        hand = op.hand_samples(torch.float32, CPU, torch.Generator().manual_seed(0))
        base = _args(op, next(s for s in hand if s.label == op.variants.base))
        assert all(one[n].dim() == base[n].dim() - 1 for n in op.variants.rows)


@pytest.mark.parametrize("op", [op for op in DECLARED if op.variants.tables], ids=lambda op: op.name)
def test_an_index_reaches_the_last_row_of_every_table(op):
    for table in op.variants.tables:
        args = _args(op, _variants(op)[f"index reaches the last row of {', '.join(table.tables)}"])
        rows = int(torch.tensor(args[table.tables[0]].shape[: table.dims]).prod())
        assert bool((args[table.index] == rows - 1).any())


def test_last_row_swap_keeps_the_answer():
    """Rows v and last swap in the table as v and last swap in the index: the lookup returns the same rows."""
    from vllm_port.ops import embedding

    hand = embedding.hand_samples(torch.float32, CPU, torch.Generator().manual_seed(0))
    base = next(s for s in hand if s.label == embedding.variants.base)
    swapped = _variants(embedding)["index reaches the last row of weight"]
    assert torch.equal(embedding.reference(*base.args), embedding.reference(*swapped.args))


def test_declaring_an_unknown_argument_is_refused():
    def ref(x: torch.Tensor) -> torch.Tensor:
        return x

    tol = {torch.float32: Tolerance(0, 0, "exact")}
    with pytest.raises(ValueError, match=r"declares variants of unknown arguments \['ids'\]"):
        Op("t", ref, tol, lambda *_: [], variants=Variants(base="s", tables=(IndexedTable("ids", ("x",)),)))


def test_a_missing_base_sample_is_named():
    def ref(x: torch.Tensor) -> torch.Tensor:
        return x

    tol = {torch.float32: Tolerance(0, 0, "exact")}
    op = Op("t", ref, tol, lambda *_: [SampleInput("small", (torch.ones(2, 3),))], variants=Variants(base="tiny"))
    with pytest.raises(ValueError, match="base sample 'tiny' is not a sample"):
        op.samples(torch.float32, CPU, torch.Generator())
