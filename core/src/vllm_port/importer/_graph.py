"""What an aten graph says about its nodes: which ops only view, cast or measure, and which values may be written.

Shared by the rewriter (``_rewrite``) and its pattern families (``_rotary``).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "CASTS",
    "SHAPE_OPS",
    "VIEWS",
    "as_int",
    "cast_dtypes",
    "is_call",
    "mutates",
    "ndim",
    "other_operand",
    "replace_node",
    "slice_range",
    "through_casts",
    "traced_value",
    "writable",
]

A = torch.ops.aten
#: Ops that only re-view their input: layout, not compute (counted in the report, not listed).
VIEWS = {
    A.view.default,
    A.reshape.default,
    A._unsafe_view.default,
    A.transpose.int,
    A.permute.default,
    A.unsqueeze.default,
    A.squeeze.dim,
    A.squeeze.default,
    A.expand.default,
    A.slice.Tensor,
    A.select.int,
    A.flatten.using_ints,
    A.unflatten.int,
    A.split_with_sizes.default,
    A.split.Tensor,
    A.contiguous.default,
    A.alias.default,
    A.t.default,
    A.movedim.int,
    A.detach.default,
    A.chunk.default,
}
#: dtype casts: compute when they change the dtype (listed as native casts), a view when they do not.
CASTS = {A.to.dtype, A._to_copy.default, A.to.dtype_layout, A.type_as.default}
#: Views through which an in-place write reaches its base element for element (``writable`` walks
#: them). Not ``expand`` (its broadcast elements share memory: a write would land twice) and not the
#: splits (handled apart: their pieces are disjoint); ``to`` may return its input itself.
SPLITS = {A.split_with_sizes.default, A.split.Tensor, A.chunk.default}
WRITE_THROUGH = (VIEWS - {A.expand.default} - SPLITS) | {A.to.dtype, A.to.dtype_layout, A.type_as.default}
SHAPE_OPS = {A.sym_size.int, A.sym_numel.default, A.sym_stride.int}


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def traced_value(node: fx.Node) -> Any:
    return node.meta.get("val")


def ndim(node: fx.Node) -> int:
    val = traced_value(node)
    return val.dim() if isinstance(val, torch.Tensor) else -1


def as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def through_casts(node: Any) -> Any:
    while is_call(node, *CASTS):
        node = node.args[0]
    return node


def other_operand(node: fx.Node, one: Any) -> Any:
    """The other operand of a binary ``node`` whose one operand is ``one`` (``None`` when neither is)."""
    a, b = node.args[0], node.args[1]
    return b if a is one else a if b is one else None


def replace_node(old: fx.Node, new: fx.Node) -> None:
    """Every read of ``old`` reads ``new``, which computes the same value (and keeps its traced value for later checks)."""
    if "val" in old.meta:
        new.meta.setdefault("val", old.meta["val"])
    old.replace_all_uses_with(new)


def writable(x: fx.Node) -> bool:
    """Whether ``x`` may be written in place: no other node reads its storage, through any alias.

    Walks from ``x`` up through the views that alias their input element for element
    (``WRITE_THROUGH``) and through a piece of a split or chunk, or a slice whose siblings are
    slices of the same dimension over other ranges (the pieces are disjoint, so a write to one is
    not seen by its siblings); every other node passed must be read by the walk's path alone. ``x`` is
    writable when the walk ends at a node that allocates its output (an op whose schema returns no
    alias, e.g. ``linear``); a placeholder, a weight, an in-place op or any other aliasing op
    (``expand``, ``as_strided``, ...) is not.
    """
    node = x
    while True:
        if is_call(node, operator.getitem) and is_call(node.args[0], *SPLITS):
            split = node.args[0]
            indices = [u.args[1] if is_call(u, operator.getitem) else None for u in split.users]
            if None in indices or len(set(indices)) != len(indices):
                return False
            node = split.args[0]
        elif is_call(node, A.slice.Tensor) and _disjoint_slices(node.args[0]):
            node = node.args[0]  # read by its slices alone, which do not overlap: q, k and v of one projection
            continue
        elif is_call(node, *WRITE_THROUGH):
            node = node.args[0]
        else:
            break
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return False
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and not any(r.alias_info is not None for r in schema.returns)


def cast_dtypes(node: fx.Node) -> str | None:
    """``"float32 -> bfloat16"`` for a cast node that changes the dtype; ``None`` otherwise."""
    source = node.args[0] if node.args else None
    before, after = traced_value(source) if isinstance(source, fx.Node) else None, traced_value(node)
    if node.target not in CASTS or not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    if before.dtype == after.dtype:
        return None
    return f"{str(before.dtype).removeprefix('torch.')} -> {str(after.dtype).removeprefix('torch.')}"


def slice_range(node: Any) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of a unit-step ``slice`` over a static dimension, clamped to it; ``None`` otherwise."""
    if not is_call(node, A.slice.Tensor):
        return None
    source = traced_value(node.args[0])
    args = [*node.args[1:], None, None, None, None][:4]
    dim, start, stop, step = (0 if args[0] is None else args[0]), args[1] or 0, args[2], args[3] or 1
    if not isinstance(source, torch.Tensor) or not all(isinstance(v, int) for v in (dim, start, step)) or step != 1:
        return None
    dim %= source.dim()
    size = source.shape[dim]
    if not isinstance(size, int) or not isinstance(stop, (int, type(None))) or start < 0 or (stop or 0) < 0:
        return None
    return dim, min(start, size), size if stop is None else max(0, min(stop, size))


def _disjoint_slices(base: Any) -> bool:
    """Whether every read of ``base`` is a slice of one dimension, and no two of them overlap."""
    if not isinstance(base, fx.Node):
        return False
    ranges = [slice_range(u) for u in base.users]
    if None in ranges or len({r[0] for r in ranges}) != 1:
        return False
    spans = sorted((r[1], r[2]) for r in ranges)
    return all(prev[1] <= nxt[0] for prev, nxt in itertools.pairwise(spans))


def mutates(node: fx.Node) -> bool:
    """Whether ``node`` writes one of its inputs (an in-place or ``out=`` op), as its schema says."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
