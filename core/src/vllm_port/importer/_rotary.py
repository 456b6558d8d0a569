"""Rotary embedding: ``x * cos + rotate_half(x) * sin`` on q and k, rewritten into one in-place ``rotary_embedding``.

The pattern is read from the graph: ``cat(-x[..., d/2:], x[..., :d/2])`` times the layer's sin
input, plus ``x`` times its cos input, both unsqueezed over the heads. Two of them (q and k) are
paired into one call. The op rotates in place; ``writable`` (``_graph``) proves, on the graph after
the linears are fused, that nothing else reads the rotated storage, else the call copies first.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from ._contract import contract_rotary
from ._graph import as_int, is_call, ndim, other_operand, replace_node, through_casts, traced_value, writable

if TYPE_CHECKING:
    from ._piece import RewriteSite

__all__ = ["rewrite_rotaries"]

A = torch.ops.aten


def rewrite_rotaries(rw: RewriteSite, cos: fx.Node | None, sin: fx.Node | None) -> None:
    """Replace each pair of rotary embeddings over the ``cos``/``sin`` inputs with one ``contract_rotary`` call."""
    if cos is None or sin is None:
        return
    matches = [m for c in list(rw.graph.nodes) if is_call(c, A.cat.default) and (m := _match(rw, c, cos, sin))]
    if matches and rw.rotary_table is None:
        rw.report.notes.append(
            "rotary embedding recognised but left native: the model's cos/sin table is not of the NeoX form "
            "(equal halves), which rotary_embedding needs"
        )
        return
    order = rw.order()
    matches.sort(key=lambda m: order[m[0]])
    for first, second in zip(matches[0::2], matches[1::2], strict=False):
        _pair(rw, first, second)
    if len(matches) % 2:
        rw.report.notes.append(f"one rotary embedding without a partner left native ({matches[-1][1].name})")


def _table_input(node: Any, placeholder: fx.Node) -> int | None:
    """The dim at which ``node`` (the cos or sin input, unsqueezed, maybe cast) broadcasts over heads."""
    node = through_casts(node)
    if not is_call(node, A.unsqueeze.default):
        return None
    src = through_casts(node.args[0])
    if src is not placeholder:
        return None
    return node.args[1] % (ndim(src) + 1)


def _match(rw: RewriteSite, cat: fx.Node, cos: fx.Node, sin: fx.Node) -> tuple | None:
    """``(x, the final add, heads dim, the pattern's nodes)`` when ``cat`` is the rotate-half of a rotary on ``x``."""
    parts = cat.args[0]
    if len(parts) != 2 or not is_call(parts[0], A.neg.default):
        return None
    neg, lo = parts
    hi = neg.args[0]
    if not (is_call(hi, A.slice.Tensor) and is_call(lo, A.slice.Tensor)) or hi.args[0] is not lo.args[0]:
        return None
    x = lo.args[0]
    val = traced_value(x)
    if not isinstance(val, torch.Tensor):
        return None
    nd, d = val.dim(), as_int(val.shape[-1])
    last = {-1, nd - 1}
    cat_dim = cat.args[1] if len(cat.args) > 1 else 0
    if d is None or d % 2 or cat_dim not in last or lo.args[1] not in last or hi.args[1] not in last:
        return None
    if tuple(lo.args[2:4]) != (0, d // 2) or lo.args[4:] not in ((), (1,)):
        return None
    if hi.args[2] != d // 2 or (as_int(hi.args[3]) or 0) < d or hi.args[4:] not in ((), (1,)):
        return None
    if len(cat.users) != 1:
        return None
    mul_s = next(iter(cat.users))
    if not is_call(mul_s, A.mul.Tensor) or len(mul_s.users) != 1:
        return None
    add = next(iter(mul_s.users))
    if not is_call(add, A.add.Tensor):
        return None
    mul_c = other_operand(add, mul_s)
    if not is_call(mul_c, A.mul.Tensor) or len(mul_c.users) != 1:
        return None
    cos_in = other_operand(mul_c, x)
    heads = _table_input(cos_in, cos)
    if heads is None or heads != _table_input(other_operand(mul_s, cat), sin):
        return None
    inner = {neg, lo, hi, cat, mul_s, mul_c}
    if not (rw.only_read_by(x, {lo, hi, mul_c}) and all(rw.only_read_by(n, {*inner, add}) for n in inner)):
        return None
    if rw.rotary_table is not None and rw.rotary_table.shape[-1] != d:
        return None
    return x, add, heads, [lo, hi, neg, cat, mul_s, mul_c, add]


def _pair(rw: RewriteSite, first: tuple, second: tuple) -> None:
    """One ``rotary_embedding`` call for two matches (q and k), in place where ``writable`` proves it safe."""
    (xa, add_a, heads_a, nodes_a), (xb, add_b, heads_b, nodes_b) = first, second
    order = rw.order()
    later = max(xa, xb, key=order.__getitem__)
    users = [u for add in (add_a, add_b) for u in add.users]
    if heads_a != heads_b or any(order[u] <= order[later] for u in users):
        rw.report.notes.append(f"rotary embeddings {add_a.name}, {add_b.name} left native: cannot be paired")
        return
    if "rope_cos_sin_cache" not in rw.gm._buffers:
        rw.gm.register_buffer("rope_cos_sin_cache", rw.rotary_table, persistent=True)
        rw.names = {**rw.names, id(rw.rotary_table): "rope_cos_sin_cache"}
    with rw.graph.inserting_after(later):
        table = rw.graph.get_attr("rope_cos_sin_cache")
    with rw.graph.inserting_after(table):
        args = (rw.inputs["ops"], rw.inputs["positions"], xa, xb, table, heads_a)
        call = rw.graph.call_function(contract_rotary, (*args, not writable(xa), not writable(xb)))
    with rw.graph.inserting_after(call):
        out_b = rw.graph.call_function(operator.getitem, (call, 1))
        out_a = rw.graph.call_function(operator.getitem, (call, 0))
    replace_node(add_a, out_a)
    replace_node(add_b, out_b)
    rw.map(
        "rotary_embedding",
        ("rotary_embedding",),
        nodes_a + nodes_b,
        f"x * cos + rotate_half(x) * sin on {xa.name} and {xb.name}, NeoX halves",
    )
