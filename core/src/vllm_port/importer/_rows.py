"""Carry a rewritten piece's residual stream as rows ``[tokens, hidden]``, so the flat passes see what they fuse.

A traced decoder layer works on ``[1, tokens, hidden]``; the contract ops work on rows. Called on
the 3-D tensors, each contract call flattens its input and views its output back, so in the flat
graph a residual add reads views of kernel outputs and the next ``rms_norm`` reads a view of the
add. ``fused_add_rms_norm`` (core's pass) fires only on ``rms_norm(a + r)`` with ``r`` a fresh
kernel output it may overwrite, never a view, so on that graph it never fired.

:func:`carry_rows` rewrites the piece so the layout changes once, where it must:

- each ``linear``, ``rms_norm`` and gated-MLP call takes rows and gives rows, with explicit
  ``to_rows``/``from_rows`` views around it;
- an ``add`` of two operands of one shape (no broadcast, no promotion) whose rows are known is done
  on the rows: an elementwise op over two same-shape tensors commutes with viewing both alike;
- slices of the last dimension of a node whose rows are known, none overlapping (Phi-3 slices q, k
  and v out of its stored ``qkv_proj``), are the pieces of one split of the rows: the same views of
  the same elements, and the rotary's query and key are then pieces of the projection, as in a core
  model, which CUDA's rotary/cache-write fusion needs (it follows the key's views back to the rotary's
  key: a ``slice`` it follows on to the projection, a split's piece it stops at);
- a node whose rows are known is never flattened again: ``to_rows(from_rows(r, like))`` is ``r``;
- the piece's hidden input and output are rows (``ImportedModel`` passes rows between pieces).

What the rest of the piece reads (attention, rotary, native nodes) still gets the 3-D view it read
before, placed just before its first reader. Views that change the shape stay; only round trips
through the 3-D layout go.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
import torch.fx as fx

from ._contract import (
    contract_gated,
    contract_linear,
    contract_rms_norm,
    contract_rotary,
    contract_rotary_rows,
    from_rows,
    to_rows,
)
from ._graph import is_call, slice_range, traced_value

__all__ = ["carry_rows"]

A = torch.ops.aten
#: Contract calls whose second argument is the input they flatten to rows, and whose output has its leading dims.
_ROW_CALLS = (contract_linear, contract_rms_norm, contract_gated)
#: Casts that return their input itself when the dtype does not change (``_to_copy`` always copies).
_ALIAS_CASTS = (A.to.dtype, A.to.dtype_layout, A.type_as.default)


def _rows_value(val: Any) -> Any:
    """The traced value of ``val``'s rows (for the report), or ``None`` when it cannot be computed."""
    try:
        return val.flatten(0, -2) if isinstance(val, torch.Tensor) and val.dim() > 2 else val
    except Exception:
        return None


def _same_layout(a: Any, b: Any) -> bool:
    va, vb = traced_value(a), traced_value(b)
    return (
        isinstance(va, torch.Tensor)
        and isinstance(vb, torch.Tensor)
        and va.dtype == vb.dtype
        and [str(s) for s in va.shape] == [str(s) for s in vb.shape]
    )


def carry_rows(graph: fx.Graph, hidden: fx.Node | None = None, rows_output: bool = False) -> None:
    """Rewrite ``graph`` in place so its contract calls and residual adds work on rows (see the module doc).

    :param hidden: the piece's hidden-state placeholder, traced as ``[1, tokens, hidden]``: it is
        given rows ``[tokens, hidden]`` from now on (its readers read ``unsqueeze(0)`` of it).
    :param rows_output: the piece returns rows ``[tokens, hidden]`` instead of ``[1, tokens, hidden]``.
    """
    rows: dict[fx.Node, fx.Node] = {}  # a 3-D node -> the node holding its rows
    sliced: set[fx.Node] = set()  # slices already replaced by pieces of a split (erased)
    batched = None

    def rows_of(node: fx.Node) -> fx.Node:
        if node in rows:
            return rows[node]
        with graph.inserting_after(node):
            flat = graph.call_function(to_rows, (node,))
        flat.meta["val"] = _rows_value(traced_value(node))
        rows[node] = flat
        return flat

    def view_back(row_node: fx.Node, like: fx.Node, val: Any) -> fx.Node:
        while is_call(like, from_rows):  # the same leading dims, read from a node no chain of views keeps alive
            like = like.args[1]
        with graph.inserting_after(row_node):
            out = graph.call_function(from_rows, (row_node, like))
        out.meta["val"] = val
        rows[out] = row_node
        return out

    if hidden is not None:
        val = traced_value(hidden)
        with graph.inserting_after(hidden):
            batched = graph.call_function(A.unsqueeze.default, (hidden, 0))
        hidden.replace_all_uses_with(batched)
        batched.args = (hidden, 0)
        batched.meta["val"] = val
        hidden.meta["val"] = _rows_value(val)
        rows[batched] = hidden
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _same_dtype_alias(node) and node.args[0] in rows:
            rows[node] = rows[node.args[0]]  # ``x.to(x.dtype)`` is ``x`` itself
        elif node.target in _ROW_CALLS:
            x = node.args[1]
            val = traced_value(x)
            if not isinstance(x, fx.Node) or not (x in rows or (isinstance(val, torch.Tensor) and val.dim() > 2)):
                continue
            node.args = (node.args[0], rows_of(x), *node.args[2:])
            out_val = node.meta.get("val")
            node.meta["val"] = _rows_value(out_val)
            users = list(node.users)
            back = view_back(node, x, out_val)
            for user in users:
                user.replace_input_with(node, back)
        elif is_call(node, A.split_with_sizes.default) and node.args[0] in rows:
            _split_rows(graph, node, rows, view_back)
        elif is_call(node, A.slice.Tensor) and node not in sliced and node.args[0] in rows:
            sliced |= _slices_as_split(graph, node.args[0], rows, view_back)
        elif is_call(node, contract_rotary):
            _rotary_on_rows(graph, node, rows)
        elif is_call(node, A.add.Tensor) and len(node.args) == 2:
            a, b = node.args
            if not (a in rows and b in rows and _same_layout(a, b) and _same_layout(a, node)):
                continue
            with graph.inserting_before(node):
                summed = graph.call_function(A.add.Tensor, (rows[a], rows[b]), dict(node.kwargs))
            summed.meta["val"] = _rows_value(traced_value(node))
            node.replace_all_uses_with(view_back(summed, a, traced_value(node)))
            graph.erase_node(node)
    if rows_output:
        output = next(n for n in graph.nodes if n.op == "output")
        result = output.args[0]
        if isinstance(result, fx.Node):
            output.args = (rows_of(result),)
    graph.eliminate_dead_code()
    _sink_views(graph, [n for n in graph.nodes if is_call(n, to_rows, from_rows) or n is batched])


def _split_rows(graph: fx.Graph, split: fx.Node, rows: dict[fx.Node, fx.Node], view_back: Any) -> None:
    """A split of the last dimension of a node whose rows are known is done on the rows: the same pieces."""
    x, sizes = split.args[0], split.args[1]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    val = traced_value(x)
    pieces = list(split.users)
    if dim != -1 and not (isinstance(val, torch.Tensor) and dim == val.dim() - 1):
        return  # (the linears the rewrite fuses have no traced value; they split at -1)
    if not all(is_call(p, operator.getitem) and isinstance(p.args[1], int) for p in pieces):
        return
    with graph.inserting_before(split):
        split_rows = graph.call_function(A.split_with_sizes.default, (rows[x], sizes, -1))
    for piece in pieces:
        with graph.inserting_after(split_rows):
            piece_rows = graph.call_function(operator.getitem, (split_rows, piece.args[1]))
        piece_rows.meta["val"] = _rows_value(traced_value(piece))
        piece.replace_all_uses_with(view_back(piece_rows, x, traced_value(piece)))
        graph.erase_node(piece)
    graph.erase_node(split)


def _slices_as_split(graph: fx.Graph, x: fx.Node, rows: dict[fx.Node, fx.Node], view_back: Any) -> set[fx.Node]:
    """The unit-step slices of ``x``'s last dimension, when no two overlap, become pieces of one split of its rows.

    ``x[..., a:b]`` and piece ``[a, b)`` of ``split_with_sizes(rows, sizes, -1)`` are views of the same
    elements (a gap between slices becomes a piece nothing reads). Returns the slices replaced.
    """
    val = traced_value(x)
    if not isinstance(val, torch.Tensor) or not isinstance(width := val.shape[-1], int):
        return set()
    if val.dim() != 3 or str(val.shape[0]) != "1":
        return set()  # rows of ``[1, T, d]`` are a view of it, whatever its strides: a write to a piece is one to x
    spans = sorted(
        (
            (span[1], span[2], user)
            for user in x.users
            if (span := slice_range(user)) is not None and span[0] == val.dim() - 1 and span[1] <= span[2]
        ),
        key=lambda s: s[:2],
    )
    if not spans or any(prev[1] > nxt[0] for prev, nxt in itertools.pairwise(spans)):
        return set()  # overlapping slices share elements: no split gives both
    sizes: list[int] = []
    piece_of: dict[fx.Node, int] = {}
    cursor = 0
    for start, stop, user in spans:
        if start > cursor:
            sizes.append(start - cursor)
        piece_of[user] = len(sizes)
        sizes.append(stop - start)
        cursor = stop
    if cursor < width:
        sizes.append(width - cursor)
    order = {n: i for i, n in enumerate(graph.nodes)}
    with graph.inserting_before(min(piece_of, key=order.__getitem__)):
        split_rows = graph.call_function(A.split_with_sizes.default, (rows[x], sizes, -1))
    for piece, index in piece_of.items():
        with graph.inserting_after(split_rows):
            piece_rows = graph.call_function(operator.getitem, (split_rows, index))
        piece_rows.meta["val"] = _rows_value(traced_value(piece))
        piece.replace_all_uses_with(view_back(piece_rows, x, traced_value(piece)))
        graph.erase_node(piece)
    return set(piece_of)


def _heads_of_rows(x: Any, rows: dict[fx.Node, fx.Node]) -> fx.Node | None:
    """The rows ``[tokens, heads * d]`` of ``x`` when ``x`` is ``g.view(1, tokens, heads, d).transpose(1, 2)``.

    ``alias`` nodes on the way are looked through: an alias is the same view of the same elements
    (Phi-3's ``q[..., :rotary_dim]`` over the whole head traces as one).
    """
    while is_call(x, A.alias.default):
        x = x.args[0]
    if not is_call(x, A.transpose.int) or tuple(x.args[1:]) not in ((1, 2), (2, 1)):
        return None
    view = x.args[0]
    if not is_call(view, A.view.default) or view.args[0] not in rows:  # a view, never a copy (reshape may copy)
        return None
    heads, source = traced_value(view), traced_value(view.args[0])
    if not isinstance(heads, torch.Tensor) or not isinstance(source, torch.Tensor):
        return None
    if heads.dim() != 4 or source.dim() != 3 or heads.shape[0] != 1:
        return None
    if str(heads.shape[1]) != str(source.shape[1]) or str(heads.shape[2] * heads.shape[3]) != str(source.shape[2]):
        return None
    return rows[view.args[0]]


def _rotary_on_rows(graph: fx.Graph, rotary: fx.Node, rows: dict[fx.Node, fx.Node]) -> None:
    """``contract_rotary`` of head views of known rows, in place (no copy), becomes ``contract_rotary_rows``.

    ``g.view(1, T, H, d).transpose(1, 2)`` seen tokens first is ``g.view(T, H, d)``: the op rotates
    the same elements through the rows, and the head views read them rotated afterwards.
    """
    ops, positions, query, key, table, heads_dim, copy_query, copy_key = rotary.args
    if heads_dim != 1 or copy_query or copy_key:
        return
    query_rows, key_rows = _heads_of_rows(query, rows), _heads_of_rows(key, rows)
    if query_rows is None or key_rows is None:
        return
    rotary.target = contract_rotary_rows
    rotary.args = (ops, positions, query_rows, key_rows, table, query, key)


def _same_dtype_alias(node: fx.Node) -> bool:
    """Whether ``node`` is a cast to the dtype (and device) its input already has: it returns the input itself."""
    if not is_call(node, *_ALIAS_CASTS) or node.kwargs.get("copy") or (len(node.args) > 3 and node.args[3]):
        return False
    source = node.args[0]
    before, after = traced_value(source) if isinstance(source, fx.Node) else None, traced_value(node)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return False
    return before.dtype == after.dtype and before.device == after.device


def _sink_views(graph: fx.Graph, views: list[fx.Node]) -> None:
    """Move each layout node made here just before its first reader.

    A view placed early reads its source before the source's other readers; in the flat graph
    that makes the residual sum look read before its norm, and ``fused_add_rms_norm`` refuses it.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in views:
        if node.graph is not graph or not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if first.op != "output" and order[first] > order[node]:
            first.prepend(node)
