"""Recognise what subgraphs of a traced piece compute, and rewrite them into contract-op calls.

Recognition reads the aten graph, never a module's class name: an RMSNorm is ``w * (x *
rsqrt(mean(x^2, -1) + eps))`` with its casts, whatever module computed it; rotary embedding is
``x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin`` over the layer's cos/sin inputs; a gated MLP
is ``act(a) * b`` over the two halves of one projection (after the linears that read the same input
are fused into one); attention is the node transformers' attention seam left (see ``_trace``).
A pattern replaces its nodes only when every intermediate value is read inside the pattern alone,
so nothing else observes a value that no longer exists. What matches nothing stays: native aten
nodes, run as traced.

Rewritten nodes call the small ``contract_*`` functions below with the bound ops as the graph's
first input, so one rewritten graph runs with any binding: eagerly, under ``vllm_port.flat.trace``
(each becomes one contract node) and under ``torch.compile``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..models.llama import paged_attention_step
from ._trace import attention_marker

__all__ = [
    "Mapped",
    "PieceReport",
    "contract_attention",
    "contract_embedding",
    "contract_gated",
    "contract_linear",
    "contract_rms_norm",
    "contract_rotary",
    "rewrite_piece",
]

A = torch.ops.aten
_MARKER = attention_marker._opoverload
#: Ops that only re-view (or, for same-dtype ``to``, return) their input: layout, not compute.
_VIEWS = {
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
    A.to.dtype,
    A._to_copy.default,
    A.detach.default,
}
_CASTS = {A.to.dtype, A._to_copy.default, A.to.dtype_layout}
_SHAPE = {A.sym_size.int, A.sym_numel.default, A.sym_stride.int}


# --- what rewritten graphs call --------------------------------------------------------------------


def contract_embedding(ops: Any, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``embedding`` over ids of any shape."""
    return ops.embedding(input_ids.reshape(-1), weight).view(*input_ids.shape, weight.shape[1])


def contract_rms_norm(ops: Any, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``rms_norm`` over the last dimension of ``x`` (leading dimensions flattened for the kernel)."""
    return ops.rms_norm(x.flatten(0, -2), weight, epsilon).view(x.shape)


def contract_linear(ops: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear`` over the last dimension of ``x``."""
    return ops.linear(x.flatten(0, -2), weight, bias).view(*x.shape[:-1], weight.shape[0])


def contract_gated(ops: Any, gate_up: torch.Tensor, activation: str, approximate: str) -> torch.Tensor:
    """``silu_and_mul`` (or ``gelu_and_mul``) of a projection holding the gate then the up half."""
    flat = gate_up.flatten(0, -2)
    out = ops.silu_and_mul(flat) if activation == "silu" else ops.gelu_and_mul(flat, approximate)
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def contract_rotary(
    ops: Any,
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    heads_dim: int,
    copy_query: bool,
    copy_key: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding`` of ``query`` and ``key`` (``[1, ..., head_size]``, heads at ``heads_dim``).

    The op rotates in place through ``[tokens, heads, head_size]`` views; a tensor whose storage
    something else still reads is copied first (``copy_*``, decided from the graph).
    """

    def tokens_first(x: torch.Tensor, copy: bool) -> torch.Tensor:
        t = x.movedim(heads_dim, -2).flatten(0, -3)
        return t.clone() if copy else t

    q, k = tokens_first(query, copy_query), tokens_first(key, copy_key)
    ops.rotary_embedding(positions, q, k, q.shape[-1], cos_sin_cache, True)

    def back(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return t.view(*like.movedim(heads_dim, -2).shape).movedim(-2, heads_dim)

    return back(q, query), back(k, key)


def contract_attention(
    ops: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: Any,
    scale: float,
    sliding_window: int,
    soft_cap: float,
) -> torch.Tensor:
    """Attention with the paged KV cache: the step's keys and values written, then decode or prefill attention.

    Takes transformers' attention-function layout (``[1, heads, tokens, head_size]``) and returns
    its output layout (``[1, tokens, heads, head_size]``).
    """
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (query, key, value))
    return paged_attention_step(ops, q, k, v, (key_cache, value_cache), meta, scale, sliding_window, soft_cap)[None]


_CONTRACT_CALLS: dict[Callable[..., Any], tuple[str, ...]] = {
    contract_embedding: ("embedding",),
    contract_rms_norm: ("rms_norm",),
    contract_linear: ("linear",),
    contract_gated: ("silu_and_mul",),
    contract_rotary: ("rotary_embedding",),
    contract_attention: ("reshape_and_cache", "paged_attention|prefill_attention"),
}


# --- the report ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mapped:
    """One recognised subgraph: what it computes, the contract ops that now compute it, the nodes it replaced."""

    piece: str
    pattern: str
    ops: tuple[str, ...]
    replaced: tuple[str, ...]
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "piece": self.piece,
            "pattern": self.pattern,
            "ops": list(self.ops),
            "replaced": list(self.replaced),
            "detail": self.detail,
        }


@dataclass
class PieceReport:
    """A piece after the rewrite: its recognised subgraphs, and its nodes that stay native torch (views apart)."""

    piece: str
    mapped: list[Mapped] = field(default_factory=list)
    native: list[dict[str, str]] = field(default_factory=list)
    views: int = 0
    notes: list[str] = field(default_factory=list)


# --- the rewriter ----------------------------------------------------------------------------------


def _is(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: fx.Node) -> Any:
    return node.meta.get("val")


def _ndim(node: fx.Node) -> int:
    val = _val(node)
    return val.dim() if isinstance(val, torch.Tensor) else -1


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _through_casts(node: Any) -> Any:
    while _is(node, *_CASTS):
        node = node.args[0]
    return node


def _other(node: fx.Node, one: Any) -> Any:
    """The other operand of a binary ``node`` whose one operand is ``one`` (``None`` when neither is)."""
    a, b = node.args[0], node.args[1]
    return b if a is one else a if b is one else None


class _Rewriter:
    def __init__(
        self,
        gm: fx.GraphModule,
        piece: str,
        names: Mapping[int, str],
        rotary_table: torch.Tensor | None,
        inputs: dict[str, fx.Node],
    ) -> None:
        self.gm, self.graph, self.piece, self.names = gm, gm.graph, piece, names
        self.rotary_table = rotary_table
        self.inputs = inputs  # added placeholders: ops, positions, key_cache, value_cache, meta
        self.report = PieceReport(piece)
        self._fresh_attr = 0

    # helpers
    def order(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def attr(self, node: Any) -> torch.Tensor | None:
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = getattr(self.gm, str(node.target), None)
            return value if isinstance(value, torch.Tensor) else None
        return None

    def name(self, node: fx.Node) -> str:
        tensor = self.attr(node)
        return self.names.get(id(tensor), str(node.target)) if tensor is not None else node.name

    def new_attr(self, tensor: torch.Tensor, name: str) -> fx.Node:
        self._fresh_attr += 1
        target = f"_imported_{self._fresh_attr}"
        self.gm.register_buffer(target, tensor, persistent=True)
        self.names = {**self.names, id(tensor): name}
        return self.graph.get_attr(target)

    def map(self, pattern: str, ops: tuple[str, ...], nodes: list[fx.Node], detail: str) -> None:
        self.report.mapped.append(Mapped(self.piece, pattern, ops, tuple(n.name for n in nodes), detail))

    @staticmethod
    def only_read_by(node: fx.Node, allowed: set[fx.Node]) -> bool:
        return set(node.users) <= allowed

    # RMSNorm ----------------------------------------------------------------------------------------
    def rms_norms(self) -> None:
        for r in list(self.graph.nodes):
            if _is(r, A.rsqrt.default):
                self._rms_norm(r)

    def _rms_norm(self, r: fx.Node) -> None:
        add = r.args[0]
        if not _is(add, A.add.Tensor, A.add.Scalar):
            return
        mean = next((a for a in add.args if isinstance(a, fx.Node)), None)
        eps = next((a for a in add.args if isinstance(a, (int, float))), None)
        if eps is None or not _is(mean, A.mean.dim) or not (len(mean.args) > 2 and mean.args[2]):
            return
        sq, dims = mean.args[0], list(mean.args[1])
        if _is(sq, A.pow.Tensor_Scalar) and sq.args[1] == 2:
            xc = sq.args[0]
        elif _is(sq, A.mul.Tensor) and sq.args[0] is sq.args[1]:
            xc = sq.args[0]
        else:
            return
        if dims not in ([-1], [_ndim(xc) - 1]) or len(r.users) != 1:
            return
        scaled = next(iter(r.users))
        if not _is(scaled, A.mul.Tensor) or _through_casts(_other(scaled, r)) is not _through_casts(xc):
            return
        out, casts = scaled, []
        while len(out.users) == 1 and _is(next(iter(out.users)), *_CASTS):
            out = next(iter(out.users))
            casts.append(out)
        if len(out.users) != 1:
            return
        final = next(iter(out.users))
        weight = _other(final, out) if _is(final, A.mul.Tensor) else None
        w = self.attr(weight)
        x = _through_casts(xc)
        val = _val(x)
        if w is None or w.dim() != 1 or not isinstance(val, torch.Tensor) or w.shape[0] != val.shape[-1]:
            return
        inner = [sq, mean, add, r, scaled, *casts]
        if not all(self.only_read_by(n, {*inner, final}) for n in inner):
            return
        with self.graph.inserting_before(final):
            call = self.graph.call_function(contract_rms_norm, (self.inputs["ops"], x, weight, float(eps)))
        final.replace_all_uses_with(call)
        self.map("rms_norm", ("rms_norm",), [*inner, final], f"eps={eps:g}, weight {self.name(weight)}")

    # rotary -----------------------------------------------------------------------------------------
    def rotaries(self, cos: fx.Node | None, sin: fx.Node | None) -> None:
        if cos is None or sin is None:
            return
        matches = [m for c in list(self.graph.nodes) if _is(c, A.cat.default) and (m := self._rotary(c, cos, sin))]
        if matches and self.rotary_table is None:
            self.report.notes.append(
                "rotary embedding recognised but left native: the model's cos/sin table is not of the NeoX form "
                "(equal halves), which rotary_embedding needs"
            )
            return
        order = self.order()
        matches.sort(key=lambda m: order[m[0]])
        for first, second in zip(matches[0::2], matches[1::2], strict=False):
            self._rotary_pair(first, second)
        if len(matches) % 2:
            self.report.notes.append(f"one rotary embedding without a partner left native ({matches[-1][1].name})")

    def _table_input(self, node: Any, placeholder: fx.Node) -> int | None:
        """The dim at which ``node`` (the cos or sin input, unsqueezed, maybe cast) broadcasts over heads."""
        node = _through_casts(node)
        if not _is(node, A.unsqueeze.default):
            return None
        src = _through_casts(node.args[0])
        if src is not placeholder:
            return None
        return node.args[1] % (_ndim(src) + 1)

    def _rotary(self, cat: fx.Node, cos: fx.Node, sin: fx.Node) -> tuple | None:
        parts = cat.args[0]
        if len(parts) != 2 or not _is(parts[0], A.neg.default):
            return None
        neg, lo = parts
        hi = neg.args[0]
        if not (_is(hi, A.slice.Tensor) and _is(lo, A.slice.Tensor)) or hi.args[0] is not lo.args[0]:
            return None
        x = lo.args[0]
        val = _val(x)
        if not isinstance(val, torch.Tensor):
            return None
        nd, d = val.dim(), _int(val.shape[-1])
        last = {-1, nd - 1}
        cat_dim = cat.args[1] if len(cat.args) > 1 else 0
        if d is None or d % 2 or cat_dim not in last or lo.args[1] not in last or hi.args[1] not in last:
            return None
        if tuple(lo.args[2:4]) != (0, d // 2) or lo.args[4:] not in ((), (1,)):
            return None
        if hi.args[2] != d // 2 or (_int(hi.args[3]) or 0) < d or hi.args[4:] not in ((), (1,)):
            return None
        if len(cat.users) != 1:
            return None
        mul_s = next(iter(cat.users))
        if not _is(mul_s, A.mul.Tensor) or len(mul_s.users) != 1:
            return None
        add = next(iter(mul_s.users))
        if not _is(add, A.add.Tensor):
            return None
        mul_c = _other(add, mul_s)
        if not _is(mul_c, A.mul.Tensor) or len(mul_c.users) != 1:
            return None
        cos_in = _other(mul_c, x)
        heads = self._table_input(cos_in, cos)
        if heads is None or heads != self._table_input(_other(mul_s, cat), sin):
            return None
        inner = {neg, lo, hi, cat, mul_s, mul_c}
        if not (self.only_read_by(x, {lo, hi, mul_c}) and all(self.only_read_by(n, {*inner, add}) for n in inner)):
            return None
        if self.rotary_table is not None and self.rotary_table.shape[-1] != d:
            return None
        return x, add, heads, [lo, hi, neg, cat, mul_s, mul_c, add]

    def _writable(self, x: fx.Node) -> bool:
        """Whether ``x``'s storage may be rotated in place: read through no other path than ``x``."""
        node = x
        while _is(node, *_VIEWS):
            node = node.args[0]
            if len(node.users) != 1 and not _is(node, A.split_with_sizes.default, A.split.Tensor):
                return False
        return node.op == "call_function" and node.target is not operator.getitem

    def _rotary_pair(self, first: tuple, second: tuple) -> None:
        (xa, add_a, heads_a, nodes_a), (xb, add_b, heads_b, nodes_b) = first, second
        order = self.order()
        later = max(xa, xb, key=order.__getitem__)
        users = [u for add in (add_a, add_b) for u in add.users]
        if heads_a != heads_b or any(order[u] <= order[later] for u in users):
            self.report.notes.append(f"rotary embeddings {add_a.name}, {add_b.name} left native: cannot be paired")
            return
        if "rope_cos_sin_cache" not in self.gm._buffers:
            self.gm.register_buffer("rope_cos_sin_cache", self.rotary_table, persistent=True)
            self.names = {**self.names, id(self.rotary_table): "rope_cos_sin_cache"}
        with self.graph.inserting_after(later):
            table = self.graph.get_attr("rope_cos_sin_cache")
        with self.graph.inserting_after(table):
            args = (self.inputs["ops"], self.inputs["positions"], xa, xb, table, heads_a)
            call = self.graph.call_function(contract_rotary, (*args, not self._writable(xa), not self._writable(xb)))
        with self.graph.inserting_after(call):
            out_b = self.graph.call_function(operator.getitem, (call, 1))
            out_a = self.graph.call_function(operator.getitem, (call, 0))
        add_a.replace_all_uses_with(out_a)
        add_b.replace_all_uses_with(out_b)
        self.map(
            "rotary_embedding",
            ("rotary_embedding",),
            nodes_a + nodes_b,
            f"x * cos + rotate_half(x) * sin on {xa.name} and {xb.name}, NeoX halves",
        )

    # linears ----------------------------------------------------------------------------------------
    def _linear_parts(self, node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
        if not _is(node, A.linear.default):
            return None
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        w = self.attr(weight)
        if w is None or w.dim() != 2 or (bias is not None and self.attr(bias) is None):
            return None
        return x, weight, bias

    def fuse_linears(self) -> None:
        """Linears reading the same input become one over the concatenated weights (q/k/v; gate/up)."""
        groups: dict[fx.Node, list[fx.Node]] = {}
        for node in self.graph.nodes:
            parts = self._linear_parts(node)
            if parts is not None:
                groups.setdefault(parts[0], []).append(node)
        for x, group in groups.items():
            weights = [self.attr(n.args[1]) for n in group]
            biased = [self._linear_parts(n)[2] is not None for n in group]
            if len(group) < 2 or len(set(biased)) != 1 or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
                continue
            names = [self.name(n.args[1]) for n in group]
            fused_name = _fused_name(names)
            with self.graph.inserting_before(group[0]):
                w_node = self.new_attr(torch.cat(weights), fused_name)
                b_node = None
                if biased[0]:
                    bias = torch.cat([self.attr(n.args[2]) for n in group])
                    b_node = self.new_attr(bias, fused_name.removesuffix("weight") + "bias")
                fused = self.graph.call_function(A.linear.default, (x, w_node, b_node))
                sizes = [int(w.shape[0]) for w in weights]
                split = self.graph.call_function(A.split_with_sizes.default, (fused, sizes, -1))
                fused.meta["fused_from"] = names
                parts = [self.graph.call_function(operator.getitem, (split, i)) for i in range(len(group))]
            for node, part in zip(group, parts, strict=True):
                node.replace_all_uses_with(part)
                self.graph.erase_node(node)
            self.report.notes.append(f"fused {' + '.join(names)} into one linear")

    def gated(self) -> None:
        activations = {A.silu.default: "silu", A.gelu.default: "gelu"}
        for mul in list(self.graph.nodes):
            if not _is(mul, A.mul.Tensor):
                continue
            act, up = mul.args[0], mul.args[1]
            if not _is(act, *activations):
                act, up = up, act
            if not _is(act, *activations) or len(act.users) != 1:
                continue
            gate = act.args[0]
            if not (_is(gate, operator.getitem) and _is(up, operator.getitem)) or gate.args[0] is not up.args[0]:
                continue
            split = gate.args[0]
            if not _is(split, A.split_with_sizes.default) or (gate.args[1], up.args[1]) != (0, 1):
                continue
            sizes = list(split.args[1])
            if len(sizes) != 2 or sizes[0] != sizes[1] or split.args[2] not in (-1, _ndim(split.args[0]) - 1):
                continue
            if len(gate.users) != 1 or len(up.users) != 1 or len(split.users) != 2:
                continue
            name = activations[act.target]
            approximate = act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
            if name == "gelu" and approximate not in ("none", "tanh"):
                continue
            y = split.args[0]
            with self.graph.inserting_before(mul):
                call = self.graph.call_function(contract_gated, (self.inputs["ops"], y, name, approximate))
            mul.replace_all_uses_with(call)
            op = "silu_and_mul" if name == "silu" else "gelu_and_mul"
            fused = ", ".join(y.meta.get("fused_from", [y.name]))
            self.map("gated_mlp", (op,), [split, gate, up, act, mul], f"{name}(gate) * up over the halves of {fused}")

    def linears(self) -> None:
        for node in list(self.graph.nodes):
            parts = self._linear_parts(node)
            if parts is None:
                continue
            x, weight, bias = parts
            with self.graph.inserting_before(node):
                call = self.graph.call_function(contract_linear, (self.inputs["ops"], x, weight, bias))
            node.replace_all_uses_with(call)
            fused = node.meta.get("fused_from")
            detail = f"{' + '.join(fused)} (fused)" if fused else self.name(weight)
            self.map("linear", ("linear",), [node], detail + (" with bias" if bias is not None else ""))

    def embeddings(self) -> None:
        for node in list(self.graph.nodes):
            if not _is(node, A.embedding.default) or self.attr(node.args[0]) is None:
                continue
            with self.graph.inserting_before(node):
                call = self.graph.call_function(contract_embedding, (self.inputs["ops"], node.args[1], node.args[0]))
            node.replace_all_uses_with(call)
            self.map("embedding", ("embedding",), [node], self.name(node.args[0]))

    # attention --------------------------------------------------------------------------------------
    def attention(self) -> dict[str, Any] | None:
        markers = [n for n in self.graph.nodes if _is(n, _MARKER)]
        if not markers:
            return None
        if len(markers) > 1:
            from ._trace import ImporterError

            raise ImporterError(
                f"{self.piece} attends {len(markers)} times; one KV cache per layer serves one attention, so this "
                "layer cannot be imported"
            )
        (marker,) = markers
        q, k, v, scale, window, cap = marker.args
        out, vv = _val(marker), _val(v)  # q and k may already be the rotary's outputs (no traced shapes)
        facts = {
            "num_heads": int(out.shape[2]),
            "num_kv_heads": int(vv.shape[1]),
            "head_size": int(vv.shape[-1]),
            "scale": float(scale),
            "sliding_window": int(window),
            "soft_cap": float(cap),
        }
        i = self.inputs
        with self.graph.inserting_before(marker):
            args = (i["ops"], q, k, v, i["key_cache"], i["value_cache"], i["meta"], scale, window, cap)
            call = self.graph.call_function(contract_attention, args)
        marker.replace_all_uses_with(call)
        self.graph.erase_node(marker)
        window_text = f", sliding window {window}" if window else ""
        self.map(
            "attention",
            ("reshape_and_cache", "paged_attention | prefill_attention"),
            [marker],
            f"{facts['num_heads']} heads over {facts['num_kv_heads']} KV heads of {facts['head_size']}, "
            f"scale {float(scale):.4g}{window_text}; the model's own KV cache replaced by the paged one",
        )
        return facts

    # finishing --------------------------------------------------------------------------------------
    def finish(self) -> None:
        self.graph.eliminate_dead_code()
        self._rename_weights()
        self.graph.lint()
        self.gm.recompile()
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target in _CONTRACT_CALLS or node.target is operator.getitem:
                continue
            if node.target in _SHAPE or (not isinstance(_val(node), torch.Tensor) and node.target not in _VIEWS):
                continue
            if node.target in _VIEWS:
                self.report.views += 1
                continue
            self.report.native.append({"piece": self.piece, "node": node.name, "op": _op_name(node.target)})

    def _rename_weights(self) -> None:
        """Name each weight after the parameter it is (``self_attn_o_proj_weight``); drop what nothing reads."""
        used: dict[str, str] = {}
        for node in self.graph.nodes:
            if node.op != "get_attr":
                continue
            tensor = self.attr(node)
            if tensor is None:
                continue
            old = str(node.target)
            if old not in used:
                new = _identifier(self.names.get(id(tensor), old))
                while new in used.values() and used.get(old) != new:
                    new += "_"
                used[old] = new
            node.target = used[old]
        tensors = {old: getattr(self.gm, old) for old in used}
        for name in [*self.gm._parameters, *self.gm._buffers]:
            delattr(self.gm, name)
        for key in [k for k, v in vars(self.gm).items() if isinstance(v, torch.Tensor)]:
            delattr(self.gm, key)
        for old, new in used.items():
            self.gm.register_buffer(new, tensors[old].detach(), persistent=True)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', str(target))}".lstrip(".")


def _identifier(name: str) -> str:
    return re.sub(r"\W", "_", name).strip("_") or "weight"


def _fused_name(names: list[str]) -> str:
    """``self_attn.q_proj.weight`` + ``self_attn.k_proj.weight`` -> ``self_attn.q_proj+k_proj.weight``."""
    split = [n.split(".") for n in names]
    prefix = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    leaves = ["_".join(s[len(prefix) : -1]) or s[-1] for s in split]
    return ".".join([*prefix, "_".join(leaves), split[0][-1]])


def rewrite_piece(
    gm: fx.GraphModule,
    piece: str,
    names: Mapping[int, str],
    *,
    rotary_table: torch.Tensor | None = None,
    cos: fx.Node | None = None,
    sin: fx.Node | None = None,
) -> tuple[fx.GraphModule, PieceReport, dict[str, Any] | None]:
    """Rewrite ``gm`` in place; return it, its report and its attention's facts (``None`` without attention).

    New leading inputs are added: ``ops, positions, key_cache, value_cache, meta`` (in that order,
    before the traced ones).

    :param names: ``id(tensor) -> parameter name`` for the weights the piece reads.
    :param rotary_table: the ``rotary_embedding`` table of the model's cos/sin (``None``: rotary stays native).
    :param cos: ``sin``: the placeholders of the cos and sin inputs, when the piece has them.
    """
    graph = gm.graph
    first = next(iter(graph.nodes))
    inputs = {}
    with graph.inserting_before(first):
        for name in ("ops", "positions", "key_cache", "value_cache", "meta"):
            inputs[name] = graph.placeholder(f"{name}_")
    rewriter = _Rewriter(gm, piece, names, rotary_table, inputs)
    rewriter.rms_norms()
    rewriter.rotaries(cos, sin)
    rewriter.fuse_linears()
    rewriter.gated()
    rewriter.linears()
    rewriter.embeddings()
    facts = rewriter.attention()
    rewriter.finish()
    return gm, rewriter.report, facts
