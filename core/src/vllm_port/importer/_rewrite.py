"""Recognise what subgraphs of a traced piece compute, and rewrite them into contract-op calls.

Recognition reads the aten graph, never a module's class name: an RMSNorm is ``w * (x *
rsqrt(mean(x^2, -1) + eps))`` with its casts, whatever module computed it; rotary embedding is
``x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin`` over the layer's cos/sin inputs; a gated MLP
is ``act(a) * b`` over the two halves of one projection (after the linears that read the same input
are fused into one, or stored fused: Phi-3's ``gate_up_proj``); attention is the node
transformers' attention seam left (see ``_trace``). Before the patterns, what computes nothing at
inference goes (dropout in eval, concatenations with empty tensors) and ops over small weights
alone are folded into constants (Gemma-2's ``1 + weight`` norms).
A pattern replaces its nodes only when every intermediate value is read inside the pattern alone,
so nothing else observes a value that no longer exists. What matches nothing stays: native aten
nodes, run as traced.

Rewritten nodes call the small ``contract_*`` functions of ``_contract`` with the bound ops as the
graph's first input, so one rewritten graph runs with any binding: eagerly, under
``vllm_port.flat.trace`` (each becomes one contract node) and under ``torch.compile``.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from ._contract import (
    CONTRACT_CALLS,
    ROW_VIEWS,
    contract_attention,
    contract_embedding,
    contract_gated,
    contract_linear,
    contract_rms_norm,
)
from ._graph import (
    CASTS,
    SHAPE_OPS,
    VIEWS,
    cast_dtypes,
    is_call,
    mutates,
    ndim,
    other_operand,
    replace_node,
    slice_range,
    through_casts,
    traced_value,
)
from ._piece import PieceReport, RewriteSite
from ._rotary import rewrite_rotaries
from ._rows import carry_rows
from ._trace import ImporterError, attention_marker

__all__ = ["rewrite_piece"]

A = torch.ops.aten
_MARKER = attention_marker._opoverload


# --- the rewriter ----------------------------------------------------------------------------------


class _Rewriter(RewriteSite):
    """The rewrite of one piece: simplification, folding, then each pattern in turn."""

    # simplification ---------------------------------------------------------------------------------
    def simplify(self) -> None:
        """Drop nodes that compute nothing at inference, so the patterns see what remains.

        ``dropout`` with ``train=False`` (or ``p=0``) returns its input (Phi-3's residual dropouts);
        a ``cat`` whose other inputs are statically empty along its dimension is its one non-empty
        input (Phi-3 concatenates the rotated part of each head with the part past the rotary
        dimension, empty when the rotary covers the whole head).
        """
        for node in list(self.graph.nodes):
            if (
                is_call(node, A.dropout.default)
                and len(node.args) == 3
                and (node.args[2] is False or node.args[1] == 0)
            ):
                replace_node(node, node.args[0])
                self.graph.erase_node(node)
            elif is_call(node, A.cat.default):
                self._drop_empty_cat(node)
        self.graph.eliminate_dead_code()

    def _drop_empty_cat(self, cat: fx.Node) -> None:
        parts, out = cat.args[0], traced_value(cat)
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        if not isinstance(out, torch.Tensor) or not isinstance(dim, int):
            return
        vals = [traced_value(p) if isinstance(p, fx.Node) else None for p in parts]
        if not all(isinstance(v, torch.Tensor) and v.dim() == out.dim() for v in vals):
            return
        kept = [
            p for p, v in zip(parts, vals, strict=True) if not (isinstance(v.shape[dim], int) and v.shape[dim] == 0)
        ]
        if len(kept) != 1 or any(mutates(u) for u in cat.users):
            return  # cat allocates its result: the kept input may stand for it only where nothing writes it
        val = traced_value(kept[0])
        if val.dtype != out.dtype or val.shape != out.shape:
            return
        replace_node(cat, kept[0])
        self.graph.erase_node(cat)

    # constant folding -------------------------------------------------------------------------------
    def fold_constants(self) -> None:
        """Compute once, at import, the ops that read only vectors or scalars of the model's own weights.

        Gemma's norms scale by ``1 + weight`` computed in float32 at every call; folded, that is one
        1-D weight the ``rms_norm`` pattern can take. Only tensors of at most one dimension are read
        (norm weights, scales), so no matrix is ever copied; the result gets its own storage.
        """
        chains: dict[str, list[str]] = {}  # the weights folded over -> the ops folded, in order
        for node in list(self.graph.nodes):
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or mutates(node):
                continue
            if torch.Tag.nondeterministic_seeded in target.tags or not node.all_input_nodes:
                continue
            tensors = [self.attr(n) for n in node.all_input_nodes]
            if any(t is None or t.dim() > 1 for t in tensors):
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), self.attr)
            with torch.no_grad():
                value = target(*args, **kwargs)
            if not isinstance(value, torch.Tensor):
                continue
            sources = sorted({self.name(n) for n in node.all_input_nodes})
            roots = [s.removesuffix(".folded") for s in sources]
            root = ", ".join(roots)
            ops = [op for s, r in zip(sources, roots, strict=True) if s != r for op in chains.pop(r, [])]
            chains[root] = [*ops, _op_name(target).removeprefix("aten.")]
            with self.graph.inserting_before(node):
                const = self.new_attr(value.detach().clone(), f"{root}.folded")
            replace_node(node, const)
            self.graph.erase_node(node)
        for root, ops in chains.items():
            self.report.notes.append(f"folded at import: {root} through {', '.join(ops)} (computed once)")

    # RMSNorm ----------------------------------------------------------------------------------------
    def rms_norms(self) -> None:
        for r in list(self.graph.nodes):
            if is_call(r, A.rsqrt.default):
                self._rms_norm(r)

    def _rms_norm(self, r: fx.Node) -> None:
        add = r.args[0]
        if not is_call(add, A.add.Tensor, A.add.Scalar):
            return
        mean = next((a for a in add.args if isinstance(a, fx.Node)), None)
        eps = next((a for a in add.args if isinstance(a, (int, float))), None)
        if eps is None or not is_call(mean, A.mean.dim) or not (len(mean.args) > 2 and mean.args[2]):
            return
        sq, dims = mean.args[0], list(mean.args[1])
        if is_call(sq, A.pow.Tensor_Scalar) and sq.args[1] == 2:
            xc = sq.args[0]
        elif is_call(sq, A.mul.Tensor) and sq.args[0] is sq.args[1]:
            xc = sq.args[0]
        else:
            return
        if dims not in ([-1], [ndim(xc) - 1]) or len(r.users) != 1:
            return
        scaled = next(iter(r.users))
        if not is_call(scaled, A.mul.Tensor) or through_casts(other_operand(scaled, r)) is not through_casts(xc):
            return
        out, casts = scaled, []
        while len(out.users) == 1 and is_call(next(iter(out.users)), *CASTS):
            out = next(iter(out.users))
            casts.append(out)
        if len(out.users) != 1:
            return
        final = next(iter(out.users))
        weight = other_operand(final, out) if is_call(final, A.mul.Tensor) else None
        w = self.attr(weight)
        x = through_casts(xc)
        val = traced_value(x)
        if w is None or w.dim() != 1 or not isinstance(val, torch.Tensor) or w.shape[0] != val.shape[-1]:
            return
        inner = [sq, mean, add, r, scaled, *casts]
        if not all(self.only_read_by(n, {*inner, final}) for n in inner):
            return
        # casts after the weight (Gemma scales in float32, then casts back): the op returns x's dtype,
        # so the match ends at the last node of that dtype
        chain = [final]
        while len(chain[-1].users) == 1 and is_call(next(iter(chain[-1].users)), *CASTS):
            chain.append(next(iter(chain[-1].users)))
        dtypes = [getattr(traced_value(n), "dtype", None) for n in chain]
        if val.dtype not in dtypes:
            return
        end = len(dtypes) - 1 - dtypes[::-1].index(val.dtype)
        chain = chain[: end + 1]
        detail = f"eps={eps:g}, weight {self.name(weight)}"
        with self.graph.inserting_before(final):
            if w.dtype != val.dtype:  # the op takes the weight in x's dtype
                detail += f" (cast {str(w.dtype).removeprefix('torch.')} -> {str(val.dtype).removeprefix('torch.')})"
                weight = self.new_attr(w.to(val.dtype), self.name(weight))
            call = self.graph.call_function(contract_rms_norm, (self.inputs["ops"], x, weight, float(eps)))
        replace_node(chain[-1], call)
        self.map("rms_norm", ("rms_norm",), [*inner, *chain], detail)

    # rotary (``_rotary``) ---------------------------------------------------------------------------
    def rotaries(self, cos: fx.Node | None, sin: fx.Node | None) -> None:
        rewrite_rotaries(self, cos, sin)

    # linears ----------------------------------------------------------------------------------------
    def _linear_parts(self, node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
        if not is_call(node, A.linear.default):
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
                replace_node(node, part)
                self.graph.erase_node(node)
            self.report.notes.append(f"fused {' + '.join(names)} into one linear")

    def gated(self) -> None:
        activations = {A.silu.default: "silu", A.gelu.default: "gelu"}
        for mul in list(self.graph.nodes):
            if not is_call(mul, A.mul.Tensor):
                continue
            act, up = mul.args[0], mul.args[1]
            if not is_call(act, *activations):
                act, up = up, act
            if not is_call(act, *activations) or len(act.users) != 1:
                continue
            halves = _halves(act.args[0], up)
            if halves is None:
                continue
            y, split_nodes = halves
            name = activations[act.target]
            approximate = act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
            if name == "gelu" and approximate not in ("none", "tanh"):
                continue
            with self.graph.inserting_before(mul):
                call = self.graph.call_function(contract_gated, (self.inputs["ops"], y, name, approximate))
            replace_node(mul, call)
            op = "silu_and_mul" if name == "silu" else "gelu_and_mul"
            how = f"{name}(gate)" if name == "silu" else f"gelu(gate, approximate={approximate})"
            source = ", ".join(
                y.meta.get("fused_from", [self.name(y.args[1]) if is_call(y, A.linear.default) else y.name])
            )
            self.map("gated_mlp", (op,), [*split_nodes, act, mul], f"{how} * up over the halves of {source}")

    def linears(self) -> None:
        for node in list(self.graph.nodes):
            parts = self._linear_parts(node)
            if parts is None:
                continue
            x, weight, bias = parts
            with self.graph.inserting_before(node):
                call = self.graph.call_function(contract_linear, (self.inputs["ops"], x, weight, bias))
            replace_node(node, call)
            fused = node.meta.get("fused_from")
            detail = f"{' + '.join(fused)} (fused)" if fused else self.name(weight)
            self.map("linear", ("linear",), [node], detail + (" with bias" if bias is not None else ""))

    def embeddings(self) -> None:
        for node in list(self.graph.nodes):
            if not is_call(node, A.embedding.default) or self.attr(node.args[0]) is None:
                continue
            with self.graph.inserting_before(node):
                call = self.graph.call_function(contract_embedding, (self.inputs["ops"], node.args[1], node.args[0]))
            replace_node(node, call)
            self.map("embedding", ("embedding",), [node], self.name(node.args[0]))

    # attention --------------------------------------------------------------------------------------
    def attention(self) -> dict[str, Any] | None:
        markers = [n for n in self.graph.nodes if is_call(n, _MARKER)]
        if not markers:
            return None
        if len(markers) > 1:
            raise ImporterError(
                f"{self.who} {self.piece} attends {len(markers)} times; the paged engine gives each layer one KV "
                "cache, which serves one attention, so this layer cannot be imported. Run this model with "
                "transformers itself, or split the layer so that each decoder layer attends once"
            )
        (marker,) = markers
        q, k, v, scale, window, cap = marker.args
        out, vv = (
            traced_value(marker),
            traced_value(v),
        )  # q and k may already be the rotary's outputs (no traced shapes)
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
        replace_node(marker, call)
        self.graph.erase_node(marker)
        window_text = f", sliding window {window}" if window else ""
        window_text += f", soft cap {float(cap):g}" if cap else ""
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
            if node.target in CONTRACT_CALLS or node.target is operator.getitem:
                continue
            if node.target in SHAPE_OPS or (
                not isinstance(traced_value(node), torch.Tensor) and node.target not in VIEWS
            ):
                continue
            cast = cast_dtypes(node)
            if node.target in VIEWS or node.target in ROW_VIEWS or (node.target in CASTS and cast is None):
                self.report.views += 1
                continue
            native = {"piece": self.piece, "node": node.name, "op": _op_name(node.target)}
            self.report.native.append(native if cast is None else {**native, "cast": cast})

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


def _halves(gate: Any, up: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(y, the nodes that split it)`` when ``gate`` and ``up`` are the first and second half of ``y``'s last dim.

    The halves may come from ``split_with_sizes``/``split``/``chunk`` (Llama's fused gate/up, Phi-3's
    ``gate_up_proj.chunk(2)``) or from two slices; nothing else may read them or ``y``.
    """
    if not (isinstance(gate, fx.Node) and isinstance(up, fx.Node)) or len(gate.users) != 1 or len(up.users) != 1:
        return None
    if is_call(gate, operator.getitem) and is_call(up, operator.getitem) and gate.args[0] is up.args[0]:
        split = gate.args[0]
        y, val = split.args[0], traced_value(split.args[0])
        width = val.shape[-1] if isinstance(val, torch.Tensor) else None
        if is_call(split, A.split_with_sizes.default):  # the linears fused here have no traced value
            width = sum(split.args[1])
        if not isinstance(width, int) or width % 2 or (gate.args[1], up.args[1]) != (0, 1) or len(split.users) != 2:
            return None
        if is_call(split, A.split_with_sizes.default):
            ok = list(split.args[1]) == [width // 2] * 2
        elif is_call(split, A.split.Tensor):
            ok = split.args[1] == width // 2
        elif is_call(split, A.chunk.default):
            ok = split.args[1] == 2
        else:
            return None
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if not ok or dim not in (-1, ndim(y) - 1) or len(y.users) != 1:
            return None
        return y, [split, gate, up]
    a, b = slice_range(gate), slice_range(up)
    if a is None or b is None or gate.args[0] is not up.args[0]:
        return None
    y = gate.args[0]
    width = traced_value(y).shape[-1]
    if a[0] != ndim(y) - 1 or (a[1:], b[1:]) != ((0, width // 2), (width // 2, width)) or width % 2:
        return None
    return (y, [gate, up]) if len(y.users) == 2 else None


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
    who: str = "the model",
    rows: fx.Node | None = None,
) -> tuple[fx.GraphModule, PieceReport, dict[str, Any] | None]:
    """Rewrite ``gm`` in place; return it, its report and its attention's facts (``None`` without attention).

    New leading inputs are added: ``ops, positions, key_cache, value_cache, meta`` (in that order,
    before the traced ones).

    :param names: ``id(tensor) -> parameter name`` for the weights the piece reads.
    :param rotary_table: the ``rotary_embedding`` table of the model's cos/sin (``None``: rotary stays native).
    :param cos: ``sin``: the placeholders of the cos and sin inputs, when the piece has them.
    :param who: the model's class name, for errors.
    :param rows: the placeholder of the piece's hidden states (traced ``[1, tokens, hidden]``): the
        rewritten piece takes and returns rows ``[tokens, hidden]`` instead, and carries its residual
        stream as rows (``_rows``), so that the flat passes fuse each residual add into the next norm.
    :raises ImporterError: for a layer that attends more than once.
    """
    graph = gm.graph
    first = next(iter(graph.nodes))
    inputs = {}
    with graph.inserting_before(first):
        for name in ("ops", "positions", "key_cache", "value_cache", "meta"):
            inputs[name] = graph.placeholder(f"{name}_")
    rewriter = _Rewriter(gm, piece, names, rotary_table, inputs, who)
    rewriter.simplify()
    rewriter.fold_constants()
    rewriter.rms_norms()
    # fusion before rotary: the rotary's in-place proof (``writable``) must reason on the graph it
    # rewrites, where q and k are pieces of one fused projection, not on the linears fusion erases
    rewriter.fuse_linears()
    rewriter.rotaries(cos, sin)
    rewriter.gated()
    rewriter.linears()
    rewriter.embeddings()
    facts = rewriter.attention()
    if rows is not None:
        carry_rows(graph, rows, rows_output=True)
    rewriter.finish()
    return gm, rewriter.report, facts
