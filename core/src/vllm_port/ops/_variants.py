"""Sample variants generated from what an op declares about its arguments, not listed by hand.

Hand samples carry the shapes real models use; what they leave out is what the contract allows
around them: the other integer dtype of an index argument, a view at a non-zero storage offset, a
row count past a 64-, 128- or 256-row tile, one row (decode), several leading dimensions, the last
row of a table the op indexes. An op declares which of its arguments are which
(:class:`Variants`: index arguments and their dtypes, row arguments, indexed tables), and
:func:`generate` derives a few variants of one base sample from that, each labelled
``"<base>: <what changed>"`` so a failure names what to replay.

Every variant keeps the base's values valid (ids within the vocabulary, unique slots, swapped
table rows that keep the answer's meaning); the reference computes the expected output on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checks import INDEX_DTYPES

__all__ = ["IndexedTable", "Variants", "generate"]

#: Row counts of the generated variants: one row (decode), and one past each tile boundary
#: (64, 128, 256 rows) the grids of real kernels cross.
ROW_COUNTS = (1, 65, 129, 257)
#: Row variants above this many rows are ``large`` (an emulator runs them for tens of seconds).
LARGE_ROWS = 128
#: How a row count is split over two leading dimensions in the several-leading-dimensions variant.
_LEADING = (5, 13)
#: Elements of padding before each float argument moved to a storage offset (32 or 64 bytes:
#: aligned as a slice of a fused projection is, so a kernel's vector loads stay legal).
_FLOAT_OFFSET = 16
#: Elements of padding before each index argument in the shared index buffer (any offset: the
#: engine's slices of one upload start where the previous argument ends).
_INDEX_GAP = 3


@dataclass(frozen=True)
class IndexedTable:
    """An index argument whose values name rows of tables.

    Attributes:
        index: the index argument (ids, positions, slots, block-table entries).
        tables: the arguments it indexes; a value names a row of each of them.
        dims: how many leading dimensions of each table the value indexes, flattened (1: rows;
            2: ``reshape_and_cache``'s slots, ``block * block_size + offset``).
    """

    index: str
    tables: tuple[str, ...]
    dims: int = 1


@dataclass(frozen=True)
class Variants:
    """What an op declares so that variants of its samples can be generated (see the module docstring).

    Attributes:
        base: the label of the hand sample the variants derive from (small, and reaching every
            argument: a bias, a table row actually read).
        index: the integer index arguments and the dtypes the contract allows for each.
        rows: the arguments whose first dimension is the op's rows (tokens, sequences of a batch).
        leading: the rows may be any number of leading dimensions (none included): ``[tokens,
            hidden]``, ``[batch, tokens, hidden]`` and ``[hidden]`` are all valid.
        tables: the index arguments that name rows of other arguments.
        row_counts: the row counts of the row variants.
    """

    base: str
    index: Mapping[str, tuple[torch.dtype, ...]] = field(default_factory=dict)
    rows: tuple[str, ...] = ()
    leading: bool = False
    tables: tuple[IndexedTable, ...] = ()
    row_counts: tuple[int, ...] = ROW_COUNTS


def generate(
    spec: Variants, names: Sequence[str], base: tuple[Any, ...], gen: torch.Generator
) -> list[tuple[str, tuple[Any, ...], bool]]:
    """``(what changed, arguments, large)`` of each variant of the base sample's arguments; ``names`` are the op's."""
    args = dict(zip(names, base, strict=False))
    found: list[tuple[str, dict[str, Any]]] = []
    found += _layout_variants(spec, args)
    found += _row_variants(spec, args, gen)
    found += [(f"index reaches the last row of {', '.join(t.tables)}", _last_row(t, args)) for t in spec.tables]
    return [(what, tuple(new[n] for n in args), _rows(spec, new) > LARGE_ROWS) for what, new in found]


def _rows(spec: Variants, args: dict[str, Any]) -> int:
    return args[spec.rows[0]].shape[0] if spec.rows and args[spec.rows[0]].dim() else 1


# ------------------------------------------------------------------------------------------------
# Storage offsets and index dtypes
# ------------------------------------------------------------------------------------------------


def _layout_variants(spec: Variants, args: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every tensor at a non-zero storage offset; the index arguments in each dtype the contract allows."""
    floats = {n: _at_offset(a) for n, a in args.items() if _is_float(a)}
    if not spec.index:
        return [("every tensor at a storage offset", {**args, **floats})]
    dtypes = [d for d in INDEX_DTYPES if any(d in allowed for allowed in spec.index.values())]
    found = []
    for dtype in dtypes:
        wanted = {n: dtype if dtype in allowed else args[n].dtype for n, allowed in spec.index.items()}
        indices = _views_of_one_buffer({n: args[n] for n in spec.index}, wanted)
        name = str(dtype).removeprefix("torch.")
        found.append(
            (f"{name} index views of one buffer, every tensor at a storage offset", {**args, **floats, **indices})
        )
    return found


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _at_offset(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, contiguous, at storage offset :data:`_FLOAT_OFFSET` of a NaN-filled buffer (NaN before and after)."""
    buf = torch.full((t.numel() + 2 * _FLOAT_OFFSET,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[_FLOAT_OFFSET : _FLOAT_OFFSET + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _views_of_one_buffer(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """Each tensor as a contiguous view into one buffer per dtype, as the engine slices one upload.

    Each view starts :data:`_INDEX_GAP` elements after the previous one ends; the gaps hold the
    dtype's largest value, so a kernel reading past a view (or ignoring its offset) reads an index
    no table has.
    """
    out: dict[str, torch.Tensor] = {}
    for dtype in set(dtypes.values()):
        names = [n for n in tensors if dtypes[n] == dtype]
        device = tensors[names[0]].device
        total = sum(tensors[n].numel() + _INDEX_GAP for n in names) + _INDEX_GAP
        buf = torch.full((total,), torch.iinfo(dtype).max, dtype=dtype, device=device)
        start = _INDEX_GAP
        for n in names:
            t = tensors[n]
            out[n] = buf[start : start + t.numel()].view(t.shape)
            out[n].copy_(t)
            start += t.numel() + _INDEX_GAP
    return out


# ------------------------------------------------------------------------------------------------
# Row counts and leading dimensions
# ------------------------------------------------------------------------------------------------


def _row_variants(spec: Variants, args: dict[str, Any], gen: torch.Generator) -> list[tuple[str, dict[str, Any]]]:
    if not spec.rows:
        return []
    found = [(f"{n} row{'s' * (n != 1)}", _with_rows(spec, args, n, gen)) for n in spec.row_counts]
    if spec.leading:
        rows = _LEADING[0] * _LEADING[1]
        spread = _with_rows(spec, args, rows, gen)
        found.append(
            (f"{rows} rows as {_LEADING[0]} x {_LEADING[1]} leading dimensions", _reshape_rows(spec, spread, _LEADING))
        )
        found.append(("one row without a row dimension", _reshape_rows(spec, _with_rows(spec, args, 1, gen), ())))
    return found


def _with_rows(spec: Variants, args: dict[str, Any], n: int, gen: torch.Generator) -> dict[str, Any]:
    """``n`` rows: every row argument's rows picked from the base's (one pick for all, keeping per-row parameters
    together), then fresh values for the data (float tensors of 2 or more dims, and indices into a table)."""
    first = args[spec.rows[0]]
    pick = torch.randint(0, first.shape[0], (n,), generator=gen)
    new = dict(args)
    for name in spec.rows:
        a = args[name]
        picked = a[pick.to(a.device)]
        if a.is_floating_point() and a.dim() >= 2:
            std, mean = float(a.float().std()), float(a.float().mean())
            picked = (torch.randn(picked.shape, generator=gen) * std + mean).to(a.device, a.dtype)
        elif not a.is_floating_point() and (table := _table_rows(spec, args, name)) is not None:
            picked = torch.randint(0, table, picked.shape, generator=gen).to(a.device, a.dtype)
        new[name] = picked.contiguous()
    return new


def _table_rows(spec: Variants, args: dict[str, Any], index: str) -> int | None:
    """The number of rows the index argument ``index`` may name, or None when it indexes no table."""
    for t in spec.tables:
        if t.index == index:
            return int(torch.tensor(args[t.tables[0]].shape[: t.dims]).prod())
    return None


def _reshape_rows(spec: Variants, args: dict[str, Any], leading: tuple[int, ...]) -> dict[str, Any]:
    return {n: a.reshape((*leading, *a.shape[1:])) if n in spec.rows else a for n, a in args.items()}


# ------------------------------------------------------------------------------------------------
# The last row of an indexed table
# ------------------------------------------------------------------------------------------------


def _last_row(table: IndexedTable, args: dict[str, Any]) -> dict[str, Any]:
    """The base with rows ``v`` and the last swapped in every table, and ``v`` and the last swapped in the index.

    ``v`` is the index's first non-negative entry (a row the op reads or writes), so afterwards the
    op touches the tables' last row, and the answer means what the base's did.
    """
    index = args[table.index]
    shape = args[table.tables[0]].shape[: table.dims]
    last = int(torch.tensor(shape).prod()) - 1
    used = index[index >= 0]
    v = int(used.flatten()[0]) if used.numel() else 0
    new = dict(args)
    swapped = index.clone()
    swapped[index == v], swapped[index == last] = last, v
    new[table.index] = swapped
    for name in table.tables:
        t = args[name].clone()  # the same strides; the base sample keeps its own
        a, b = _unravel(v, shape), _unravel(last, shape)
        row_a, row_b = t[a].clone(), t[b].clone()
        t[a], t[b] = row_b, row_a
        new[name] = t
    return new


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))
