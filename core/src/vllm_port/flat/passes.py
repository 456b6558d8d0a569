"""Fusion passes over flat graphs: substitutions of contract ops that hold on every platform.

A pass rewrites the aten-level ``torch.fx`` graph of a :class:`~vllm_port.flat.flat_graph.FlatGraph`
(or the graph the ``vllm_port`` torch.compile backend lowers) in place and returns how many times
it fired. Core's passes:

- ``fused_add_rms_norm``: ``s = a + r; h = rms_norm(s, w, eps)`` becomes ``h = fused_add_rms_norm(a, r, w, eps)``,
  which adds into ``r`` in place; later readers of ``s`` read ``r``. Only where ``r`` is a fresh
  intermediate (not a graph input, weight or view) that nothing reads after the add.
- ``silu_and_mul`` / ``gelu_and_mul``: ``g, u = y.chunk(2, -1); act(g) * u`` becomes ``act_and_mul(y)``.
- ``x_sigmoid_to_silu``: ``x * sigmoid(x)`` becomes ``silu(x)`` (so the gated-MLP pass sees it).

Passes are plain substitutions of contract ops, so the rewritten graph runs eagerly with the
bound kernels as well as under ``torch.compile``. Plugins add their own through the
``vllm_port_graph_passes`` hook; they run after core's. A pass and its context
(:class:`GraphPass`, :class:`PassContext`) are the contract's vocabulary, defined on the ground floor
in :mod:`vllm_port.graph_pass` and re-exported here.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..errors import PluginError
from ..graph_pass import GraphPass, PassContext
from .flat_graph import FlatGraph, contract_op, copy_module, op_targets

__all__ = ["GraphPass", "PassContext", "apply_passes", "core_passes", "plugin_passes", "run_passes"]

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_shape(a: Any, b: Any) -> bool:
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dtype != vb.dtype:
        return False
    return [str(s) for s in va.shape] == [str(s) for s in vb.shape]


def _is_view(node: fx.Node) -> bool:
    """Whether ``node``'s output may alias one of its inputs (views, getitem of a split)."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True  # unknown: assume it aliases
    return any(r.alias_info is not None for r in schema.returns)


def _aliases(node: fx.Node) -> list[fx.Node]:
    """``node`` and every node that is a view of it, transitively."""
    found, todo = [node], [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_function" and _is_view(user) and user not in found:
                found.append(user)
                todo.append(user)
    return found


def _last_dim(node: fx.Node, dim: Any) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and isinstance(dim, int) and dim in (-1, val.dim() - 1)


def _halves(split: fx.Node) -> fx.Node | None:
    """The input ``y`` when ``split`` cuts ``y``'s last dimension into two equal halves (``chunk(2, -1)``)."""
    if split.op != "call_function" or not _is_split(split):
        return None
    y = split.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    out = _val(split)
    if not _last_dim(y, dim) or not isinstance(out, (list, tuple)) or len(out) != 2:
        return None
    if str(out[0].shape[-1]) != str(out[1].shape[-1]):
        return None
    return y


def _is_split(node: fx.Node) -> bool:
    return node.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)


def _getitem(node: Any) -> tuple[fx.Node, int] | None:
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return None


def _gated(mul: fx.Node, activation: Callable[[fx.Node], dict[str, Any] | None]) -> tuple[fx.Node, dict] | None:
    """``(y, attrs)`` when ``mul`` is ``act(y.chunk(2, -1)[0]) * y.chunk(2, -1)[1]`` (either order)."""
    if mul.op != "call_function" or mul.target != aten.mul.Tensor or len(mul.args) != 2:
        return None
    for act, up in (mul.args, mul.args[::-1]):
        if not isinstance(act, fx.Node) or len(act.users) != 1:
            continue
        attrs = activation(act)
        gate, half = _getitem(act.args[0]) if attrs is not None else None, _getitem(up)
        if gate is None or half is None or gate[0] is not half[0] or (gate[1], half[1]) != (0, 1):
            continue
        if len(act.args[0].users) != 1 or len(up.users) != 1:
            continue  # a half read elsewhere: the fused op would not produce it
        y = _halves(gate[0])
        if y is not None:
            return y, attrs
    return None


def _replace(old: fx.Node, target: Any, args: tuple, meta_from: fx.Node) -> fx.Node:
    with old.graph.inserting_before(old):
        new = old.graph.call_function(target, args)
    new.meta.update(meta_from.meta)
    old.replace_all_uses_with(new)
    return new


def _clean(module: fx.GraphModule) -> None:
    module.graph.eliminate_dead_code()  # mutating ops (cache writes, rotary) are impure and stay
    module.graph.lint()
    module.recompile()


# ------------------------------------------------------------------------------------------------
# Core's passes
# ------------------------------------------------------------------------------------------------


def fuse_add_rms_norm(module: fx.GraphModule, ctx: PassContext) -> int:
    """``rms_norm(a + r)`` -> ``fused_add_rms_norm(a, r)`` where ``r`` may be written in place."""
    if "fused_add_rms_norm" not in ctx.ops:
        return 0
    order = {n: i for i, n in enumerate(module.graph.nodes)}
    fired = 0
    for norm in list(module.graph.nodes):
        if contract_op(norm) != "rms_norm":
            continue
        add = norm.args[0]
        if not isinstance(add, fx.Node) or add.target != aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
            continue
        if len(add.args) != 2 or not all(isinstance(a, fx.Node) for a in add.args):
            continue
        x, residual = add.args
        if not _same_shape(x, residual) or not _same_shape(add, residual) or x is residual:
            continue
        if any(order[user] < order[norm] for user in add.users):
            continue  # the sum is read before the norm: it must exist on its own there
        operands = [(a, r) for a, r in ((x, residual), (residual, x)) if _may_overwrite(r, add, norm, order)]
        if not operands:
            continue
        a, r = operands[0]  # r takes the sum in place; the model's own residual first when both can
        weight, epsilon = norm.args[1], norm.args[2]
        _replace(norm, ctx.ops["fused_add_rms_norm"], (a, r, weight, epsilon), norm)
        module.graph.erase_node(norm)
        add.replace_all_uses_with(r)  # every reader of the sum runs after the fused op: r holds it
        module.graph.erase_node(add)
        order = {n: i for i, n in enumerate(module.graph.nodes)}
        fired += 1
    if fired:
        _clean(module)
    return fired


def _may_overwrite(r: fx.Node, add: fx.Node, norm: fx.Node, order: Mapping[fx.Node, int]) -> bool:
    """Whether ``r`` can take the sum in place where ``norm`` runs.

    ``r`` must be a fresh intermediate (not a graph input, a weight or a view of one) that nothing
    but ``add`` reads, directly or through a view, from ``norm`` on.
    """
    if _is_view(r) or r.op != "call_function":
        return False
    for alias in _aliases(r):
        for user in alias.users:
            if user is not add and order[user] >= order[norm]:
                return False
    return True


def fuse_silu_and_mul(module: fx.GraphModule, ctx: PassContext) -> int:
    """``silu(g) * u`` over ``g, u = y.chunk(2, -1)`` -> ``silu_and_mul(y)``."""
    return _fuse_gated(module, ctx, "silu_and_mul", lambda n: {} if n.target == aten.silu.default else None)


def fuse_gelu_and_mul(module: fx.GraphModule, ctx: PassContext) -> int:
    """``gelu(g, approximate) * u`` over ``g, u = y.chunk(2, -1)`` -> ``gelu_and_mul(y, approximate)``."""

    def gelu(node: fx.Node) -> dict[str, Any] | None:
        if node.target != aten.gelu.default:
            return None
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return {"approximate": approximate}

    return _fuse_gated(module, ctx, "gelu_and_mul", gelu)


def _fuse_gated(
    module: fx.GraphModule, ctx: PassContext, op: str, activation: Callable[[fx.Node], dict[str, Any] | None]
) -> int:
    if op not in ctx.ops:
        return 0
    fired = 0
    for mul in list(module.graph.nodes):
        found = _gated(mul, activation)
        if found is None:
            continue
        y, attrs = found
        args = (y, attrs["approximate"]) if attrs else (y,)
        _replace(mul, ctx.ops[op], args, mul)
        module.graph.erase_node(mul)
        fired += 1
    if fired:
        _clean(module)
    return fired


def x_sigmoid_to_silu(module: fx.GraphModule, ctx: PassContext) -> int:
    """``x * sigmoid(x)`` -> ``silu(x)``: the spelling the gated-MLP passes match."""
    fired = 0
    for mul in list(module.graph.nodes):
        if mul.op != "call_function" or mul.target != aten.mul.Tensor or len(mul.args) != 2:
            continue
        for x, sig in (mul.args, mul.args[::-1]):
            if isinstance(sig, fx.Node) and sig.target == aten.sigmoid.default and sig.args[0] is x:
                _replace(mul, aten.silu.default, (x,), mul)
                module.graph.erase_node(mul)
                fired += 1
                break
    if fired:
        _clean(module)
    return fired


def core_passes() -> list[GraphPass]:
    """Core's passes, in the order they run."""
    return [
        GraphPass("x_sigmoid_to_silu", x_sigmoid_to_silu),
        GraphPass("fused_add_rms_norm", fuse_add_rms_norm),
        GraphPass("silu_and_mul", fuse_silu_and_mul),
        GraphPass("gelu_and_mul", fuse_gelu_and_mul),
    ]


# ------------------------------------------------------------------------------------------------
# Running passes; plugin passes
# ------------------------------------------------------------------------------------------------


def plugin_passes(runtime: Any) -> list[GraphPass]:
    """The passes plugins contribute for ``runtime``'s platform (hook ``vllm_port_graph_passes``), in load order.

    :raises PluginError: naming the plugin whose hook raised or answered something that is not a list of GraphPass.
    """
    hook = getattr(runtime.discovery.manager.hook, "vllm_port_graph_passes", None)
    if hook is None:
        return []
    found: list[GraphPass] = []
    for impl in hook.get_hookimpls():
        try:
            answer = impl.function(platform=runtime.platform)
        except Exception as exc:
            raise PluginError(
                f"plugin {impl.plugin_name!r}: vllm_port_graph_passes raised {type(exc).__name__}: {exc}"
            ) from exc
        if answer is None:
            continue
        if not isinstance(answer, (list, tuple)) or not all(isinstance(p, GraphPass) for p in answer):
            raise PluginError(
                f"plugin {impl.plugin_name!r}: vllm_port_graph_passes returned {answer!r}; "
                "return a list of vllm_port.flat.passes.GraphPass"
            )
        found += [GraphPass(p.name, p.fn, impl.plugin_name) for p in answer]
    return found


def run_passes(module: fx.GraphModule, ctx: PassContext, passes: Sequence[GraphPass]) -> dict[str, int]:
    """Run ``passes`` in order on ``module`` (in place); return ``{pass name: times fired}``.

    :raises PluginError: when a plugin's pass raises or answers something other than a count.
    """
    fired: dict[str, int] = {}
    for graph_pass in passes:
        try:
            count = graph_pass.fn(module, ctx)
        except Exception as exc:
            if graph_pass.plugin == "vllm-port":
                raise
            raise PluginError(
                f"plugin {graph_pass.plugin!r}: graph pass {graph_pass.name!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise PluginError(
                f"plugin {graph_pass.plugin!r}: graph pass {graph_pass.name!r} returned {count!r}; "
                "return how many times it fired (an int >= 0)"
            )
        fired[graph_pass.name] = fired.get(graph_pass.name, 0) + count
    module.recompile()
    return fired


def apply_passes(graph: FlatGraph, runtime: Any = None, passes: Sequence[GraphPass] | None = None) -> FlatGraph:
    """``graph`` after fusion passes (a new graph; weights are shared, ``graph`` is untouched).

    :param runtime: when given, its plugins' passes run after core's (``vllm_port_graph_passes``).
    :param passes: the passes to run instead of core's (and the plugins').
    """
    if graph.kernels is None:
        raise ValueError("apply_passes: the graph has no bound ops to build fused nodes from; trace it with flat.trace")
    if passes is None:
        passes = core_passes() + (plugin_passes(runtime) if runtime is not None else [])
    ctx = PassContext(op_targets(graph.kernels), graph.kernels.context.platform, graph.kernels.context.dtype)
    module = copy_module(graph.module)
    fusions = dict(graph.fusions)
    for name, count in run_passes(module, ctx, passes).items():
        fusions[name] = fusions.get(name, 0) + count
    return graph.with_module(module, fusions)
