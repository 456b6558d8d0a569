"""The flat graph: one model step as an ordered list of nodes, each a contract op or a named torch op.

A :class:`FlatGraph` wraps the ``torch.fx`` graph that :func:`vllm_port.flat.trace` records (aten
level, contract ops as ``vllm_port::<op>__<plugin>__<provider>`` custom ops, shapes symbolic in
the batch dimensions) and reads it as :class:`FlatNode` records: op, kind, bound provider, inputs,
outputs, attributes, output shapes and the decoder layer. Its text form is stable: two builds of
the same model with the same providers print, compare and hash the same. It runs eagerly with
each contract node calling its provider's plain function (no custom-op dispatch on that path).
"""

from __future__ import annotations

import hashlib
import operator
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch._library.custom_ops import CustomOpDef

from ..ops import ALL_OPS, BoundOps, Provider

__all__ = [
    "CONTRACT_NAMESPACE",
    "KV_CACHE_OPS",
    "FlatGraph",
    "FlatNode",
    "contract_op",
    "contract_provider",
    "copy_module",
    "node_kind",
    "op_targets",
    "traceable_ops",
]

#: The ``torch.library`` namespace of the contract's custom ops (see ``vllm_port.ops._custom``).
CONTRACT_NAMESPACE = "vllm_port"
#: The contract ops that read or write a layer's KV cache and the attention metadata (block tables, lengths).
KV_CACHE_OPS = (
    "reshape_and_cache",
    "paged_attention",
    "prefill_attention",
    "reshape_and_cache_fp8",
    "paged_attention_fp8",
    "prefill_attention_fp8",
)
_OPS = {op.name: op for op in ALL_OPS}
#: Custom op overload -> the provider whose plain function it wraps (filled by :func:`traceable_ops`).
_EAGER: dict[torch._ops.OpOverload, Provider] = {}
_TORCH_NAMESPACES = ("aten", "prims")


def traceable_ops(kernels: BoundOps) -> BoundOps:
    """``kernels`` with every provider wrapped as a ``torch.library`` custom op, so tracers see one node per op.

    Accepts eager bindings (``runtime.bind(dtype)``) and traceable ones alike; the plain function of
    each provider is remembered, so a traced graph can later call it directly.
    """
    from ..ops._custom import as_custom_op

    wrapped: dict[str, Provider] = {}
    for name, chosen in kernels.providers.items():
        if isinstance(chosen.fn, CustomOpDef):
            custom, eager = chosen.fn, replace(chosen, fn=chosen.fn._init_fn)
        else:
            custom, eager = as_custom_op(_OPS[name], chosen), chosen
        _EAGER[custom._opoverload] = eager
        wrapped[name] = replace(chosen, fn=custom)
    return BoundOps(kernels.context, wrapped)


def op_targets(kernels: BoundOps) -> dict[str, torch._ops.OpOverload]:
    """Op name -> the custom op overload a graph node calls for it, for ``kernels``' providers."""
    return {name: p.fn._opoverload for name, p in traceable_ops(kernels).providers.items()}


def _is_contract_target(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == CONTRACT_NAMESPACE


def contract_op(node: fx.Node) -> str | None:
    """The contract op ``node`` calls (``"rms_norm"``), or ``None`` for any other node."""
    if node.op != "call_function" or not _is_contract_target(node.target):
        return None
    name = node.target._opname.split("__", 1)[0]
    return name if name in _OPS else None


def contract_provider(node: fx.Node) -> Provider | None:
    """The provider a contract node runs: its plain function, name and plugin; ``None`` for other nodes."""
    if contract_op(node) is None:
        return None
    known = _EAGER.get(node.target)
    if known is not None:
        return known
    from ..ops._custom import _made  # custom ops bound by runtime.bind(traceable=True) outside this module

    op, _, rest = node.target._opname.partition("__")
    plugin, _, name = rest.partition("__")
    custom = _made.get(f"{CONTRACT_NAMESPACE}::{node.target._opname}")
    fn = custom._init_fn if custom is not None else node.target
    return Provider(op, name, fn, plugin=plugin)


_SHAPE_TARGETS = {"sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "sym_constrain_range_for_size"}


def node_kind(node: fx.Node) -> str:
    """``"contract"``, ``"native"`` (a torch op), ``"plugin"`` (a plugin's own custom op) or ``"shape"``.

    Shape nodes compute sizes on the host (symbolic batch dimensions), never a kernel.
    """
    if contract_op(node) is not None:
        return "contract"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        if target._opname in _SHAPE_TARGETS:
            return "shape"
        return "native" if target.namespace in _TORCH_NAMESPACES else "plugin"
    if not isinstance(node.meta.get("val"), torch.Tensor) and not _tensor_list(node.meta.get("val")):
        return "shape"  # operator.mul / floordiv on SymInts
    return "native"


def _tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def _op_name(node: fx.Node) -> str:
    if (name := contract_op(node)) is not None:
        return name
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # aten.add.Tensor
    module = getattr(target, "__module__", None) or ""
    module = "operator" if target in vars(operator).values() else module.replace("_operator", "operator")
    return f"{module}.{getattr(target, '__name__', str(target))}".lstrip(".")


def _short(node: fx.Node) -> str:
    if (name := contract_op(node)) is not None:
        return name
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", "node").strip("_") or "node"


_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
    torch.uint8: "u8",
}


@dataclass(frozen=True)
class FlatNode:
    """One node of a flat graph.

    Attributes:
        name: the node's stable name in the text form (``rms_norm_3``); outputs are ``%name`` or
            ``%name.i`` for ops with several outputs.
        op: the contract op (``"rms_norm"``) or the torch op (``"aten.add.Tensor"``) it runs.
        kind: ``"contract"``, ``"native"``, ``"plugin"`` (a plugin's own fused op) or ``"shape"``.
        provider: the bound provider's name for contract nodes (``"cpu_rms_norm"``), ``"torch"`` otherwise.
        plugin: the plugin that registered the provider (``"cpu"``); ``""`` for torch ops.
        inputs: the tensors it reads: values (``%add_1``), weights (``$layers.0.in_norm``), graph inputs.
        attrs: its non-tensor arguments by the op's parameter names (``epsilon``, ``head_size``).
        outputs: the values it defines (none for ops that only write in place).
        shapes: each output's shape and dtype, batch dimensions named (``[num_tokens, 4096] bf16``).
        mutates: the inputs it writes in place.
        layer: the decoder layer it belongs to (from the weights and caches it reads), or ``None``.
    """

    name: str
    op: str
    kind: str
    provider: str
    plugin: str
    inputs: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...]
    outputs: tuple[str, ...]
    shapes: tuple[str, ...]
    mutates: tuple[str, ...]
    layer: int | None

    def to_json(self) -> dict[str, Any]:
        """The node as plain JSON values."""
        return {
            "name": self.name,
            "op": self.op,
            "kind": self.kind,
            "provider": self.provider,
            "plugin": self.plugin,
            "inputs": list(self.inputs),
            "attrs": {k: _json_value(v) for k, v in self.attrs},
            "outputs": list(self.outputs),
            "shapes": list(self.shapes),
            "mutates": list(self.mutates),
            "layer": self.layer,
        }


def _json_value(value: Any) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)(?:\.|$)")


def copy_module(module: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of ``module``'s graph; weights are shared, not copied."""
    graph = fx.Graph()
    out = graph.graph_copy(module.graph, {})
    graph.output(out)
    copied = fx.GraphModule(module, graph)
    copied.meta.update(module.meta)
    return copied


class FlatGraph:
    """A traced model step (``phase`` ``"decode"`` or ``"prefill"``) as flat nodes; see the module docstring.

    Attributes:
        module: the ``torch.fx.GraphModule`` that is the graph's truth (passes rewrite it).
        phase: ``"decode"`` or ``"prefill"``.
        input_names: the graph's inputs, in call order.
        fusions: how many times each fusion pass fired on this graph (empty before passes).
        kernels: the traceable bound ops the graph was traced with (passes add nodes for their ops).
    """

    def __init__(
        self,
        module: fx.GraphModule,
        *,
        phase: str,
        input_names: Sequence[str],
        weight_names: Mapping[str, str],
        symbol_names: Mapping[str, str],
        kernels: BoundOps | None = None,
        fusions: Mapping[str, int] | None = None,
    ) -> None:
        self.module = module
        self.phase = phase
        self.input_names = tuple(input_names)
        self.weight_names = dict(weight_names)
        self.symbol_names = dict(symbol_names)
        self.kernels = kernels
        self.fusions = dict(fusions or {})
        self._nodes: list[FlatNode] | None = None
        self._by_name: dict[str, fx.Node] = {}
        self._runner: Callable[..., Any] | None = None

    # --------------------------------------------------------------------------------------------
    # Reading
    # --------------------------------------------------------------------------------------------

    @property
    def nodes(self) -> list[FlatNode]:
        """The graph's nodes in execution order (graph inputs, weights and ``getitem`` are not nodes)."""
        if self._nodes is None:
            self._nodes = self._read()
        return self._nodes

    def __iter__(self) -> Iterator[FlatNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def fx_node(self, name: str) -> fx.Node:
        """The ``torch.fx`` node behind the flat node called ``name``."""
        self.nodes  # noqa: B018 - fills the name table
        return self._by_name[name]

    def counts(self) -> dict[str, int]:
        """How many nodes of each kind: ``{"contract": N, "native": M, "plugin": P, "shape": S}``."""
        found = {"contract": 0, "native": 0, "plugin": 0, "shape": 0}
        for node in self.nodes:
            found[node.kind] += 1
        return found

    def providers(self) -> dict[str, str]:
        """Contract op -> the provider its nodes run (one per op: a graph is bound to one platform)."""
        return {n.op: n.provider for n in self.nodes if n.kind == "contract"}

    def text(self, providers: bool = True) -> str:
        """The stable text form: one line per node; ``providers=False`` leaves out who runs each op."""
        header = f"flat graph {self.phase}({', '.join(self._input_text())})"
        lines = [header]
        for node in self.nodes:
            lines.append("  " + self._line(node, providers))
        lines.append(f"  return {', '.join(self._output_names())}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        counts = self.counts()
        return f"FlatGraph({self.phase}: {counts['contract']} contract, {counts['native']} native nodes)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatGraph) and self.text() == other.text()

    def __hash__(self) -> int:
        return hash(self.text())

    def digest(self) -> str:
        """sha256 of the text form: equal for two builds of the same graph."""
        return hashlib.sha256(self.text().encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The graph as plain JSON values: phase, inputs, nodes, counts, fusions."""
        return {
            "phase": self.phase,
            "inputs": self._input_text(),
            "nodes": [n.to_json() for n in self.nodes],
            "counts": self.counts(),
            "fusions": dict(self.fusions),
        }

    # --------------------------------------------------------------------------------------------
    # Running
    # --------------------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        """Run the graph eagerly: each contract node calls its provider's plain function."""
        if self._runner is None:
            self._runner = self.eager_module()
        return self._runner(*args)

    def eager_module(self) -> fx.GraphModule:
        """A GraphModule of this graph whose contract nodes call the providers' plain functions directly."""
        module = copy_module(self.module)
        for node in module.graph.nodes:
            chosen = contract_provider(node)
            if chosen is not None and not isinstance(chosen.fn, torch._ops.OpOverload):
                node.target = _named(chosen)
        module.recompile()
        return module

    def close(self) -> None:
        """Let go of the tensors this graph's modules hold (the traced weights); the graph cannot run after it.

        fx keeps a GraphModule and its graph in a reference cycle, so a dropped graph's weights would stay
        allocated until the garbage collector runs: a closed engine would keep them (issue 30's leak test).
        """
        for module in (self.module, self._runner):
            if module is None:
                continue
            held = [name for name, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
            held += [name for name, value in vars(module).items() if isinstance(value, torch.Tensor)]
            for name in held:  # make_fx registers the traced weights as buffers (_tensor_constant0, ...)
                delattr(module, name)
        self._runner = None

    def with_module(self, module: fx.GraphModule, fusions: Mapping[str, int]) -> FlatGraph:
        """A graph like this one over ``module`` (after passes), with ``fusions`` recorded."""
        return FlatGraph(
            module,
            phase=self.phase,
            input_names=self.input_names,
            weight_names=self.weight_names,
            symbol_names=self.symbol_names,
            kernels=self.kernels,
            fusions=fusions,
        )

    # --------------------------------------------------------------------------------------------
    # Internals: naming and rendering
    # --------------------------------------------------------------------------------------------

    def _read(self) -> list[FlatNode]:
        self._values: dict[fx.Node, str] = {}
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        for node, name in zip(placeholders, self.input_names, strict=False):
            self._values[node] = name
        counters: dict[str, int] = {}
        nodes: list[FlatNode] = []
        self._layers: dict[fx.Node, int | None] = {}
        self._weight_reads: dict[str, int] = {}
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                key = str(node.target)
                self._weight_reads[key] = self._weight_reads.get(key, 0) + len(node.users)
        for node in self.module.graph.nodes:
            if node.op == "get_attr":
                self._values[node] = "$" + self.weight_names.get(str(node.target), str(node.target))
                continue
            if node.op != "call_function":
                continue
            if node.target is operator.getitem and node.args[0] in self._values:  # one output of a split: %split.1
                self._values[node] = f"{self._values[node.args[0]]}.{node.args[1]}"
                self._layers[node] = self._layers.get(node.args[0])
                continue
            base = _short(node)
            count = counters.get(base, 0)
            counters[base] = count + 1
            name = base if count == 0 else f"{base}_{count}"
            self._by_name[name] = node
            nodes.append(self._flat_node(node, name))
        return nodes

    def _flat_node(self, node: fx.Node, name: str) -> FlatNode:
        kind = node_kind(node)
        chosen = contract_provider(node)
        args = self._named_args(node)
        tensors = [(arg, v) for arg, v in args if self._is_value(v)]
        inputs = tuple(self._render(v) for _, v in tensors)
        attrs = tuple((arg, self._plain(v)) for arg, v in args if not self._is_value(v))
        mutated = self._mutated_args(node)
        mutates = tuple(self._render(v) for arg, v in tensors if arg in mutated)
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            outputs = tuple(f"%{name}.{i}" for i in range(len(val)))
            shapes = tuple(self._shape(v) for v in val)
        elif val is None:
            outputs, shapes = (), ()
        else:
            outputs, shapes = (f"%{name}",), (self._shape(val),)
        self._values[node] = f"%{name}"
        layer = self._layer_of(node, inputs) if kind != "shape" else None
        self._layers[node] = layer
        provider, plugin = (chosen.name, chosen.plugin) if chosen is not None else ("torch", "")
        if kind == "plugin":  # a plugin's own op (a fusion of its kernels): its namespace names the plugin
            provider, plugin = node.target._opname, node.target.namespace
        flat = FlatNode(
            name=name,
            op=_op_name(node),
            kind=kind,
            provider=provider,
            plugin=plugin,
            inputs=inputs,
            attrs=attrs,
            outputs=outputs,
            shapes=shapes,
            mutates=mutates,
            layer=layer,
        )
        return flat

    def _layer_of(self, node: fx.Node, inputs: Sequence[str]) -> int | None:
        """The decoder layer of a node.

        The layer of a weight (``layers.3.*``) or cache (``k_cache_3``) it reads; else ``None`` when
        it reads a weight that only it reads (embedding, final norm, LM head); else the highest
        layer of the values it reads (a residual add, a view, rotary with the shared cos/sin table).
        """
        for value in inputs:
            match = _LAYER.search(value[1:]) if value.startswith("$") else re.fullmatch(r"[kv]_cache_(\d+)", value)
            if match:
                return int(match.group(1))
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and len(arg.users) == 1 and self._weight_reads[str(arg.target)] == 1:
                return None
        layers = [self._layers[a] for a in node.all_input_nodes if self._layers.get(a) is not None]
        return max(layers) if layers else None

    def _named_args(self, node: fx.Node) -> list[tuple[str, Any]]:
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        named = [(names[i] if i < len(names) else "", v) for i, v in enumerate(node.args)]
        return named + list(node.kwargs.items())

    def _mutated_args(self, node: fx.Node) -> set[str]:
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            return set()
        return {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    def _is_value(self, value: Any) -> bool:
        return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)

    def _render(self, value: Any) -> str:
        if isinstance(value, fx.Node):
            return self._values.get(value, f"%{value.name}")
        if isinstance(value, (list, tuple)):
            inner = ", ".join(self._render(v) for v in value)
            return f"[{inner}]" if isinstance(value, list) else f"({inner})"
        if isinstance(value, float):
            return repr(value)
        return str(value)

    def _plain(self, value: Any) -> Any:
        if isinstance(value, fx.Node):
            return self._render(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._plain(v) for v in value)
        return value

    def _dim(self, size: Any) -> str:
        if isinstance(size, torch.SymInt):
            expr = size.node.expr
            names = {s: self.symbol_names.get(str(s), str(s)) for s in expr.free_symbols}
            text = str(expr)
            for symbol, friendly in sorted(names.items(), key=lambda kv: -len(str(kv[0]))):
                text = re.sub(rf"\b{re.escape(str(symbol))}\b", friendly, text)
            return text
        return str(size)

    def _shape(self, value: Any) -> str:
        if isinstance(value, torch.Tensor):
            dims = ", ".join(self._dim(s) for s in value.shape)
            return f"[{dims}] {_DTYPES.get(value.dtype, str(value.dtype).replace('torch.', ''))}"
        if isinstance(value, torch.SymInt):
            return self._dim(value)
        return "int" if value is None else type(value).__name__  # an int input the tracer kept constant

    def _input_text(self) -> list[str]:
        self.nodes  # noqa: B018 - names the values
        placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        return [f"{self._values[n]}: {self._shape(n.meta.get('val'))}" for n in placeholders]

    def _output_names(self) -> list[str]:
        self.nodes  # noqa: B018
        output = next(n for n in self.module.graph.nodes if n.op == "output")
        flat, _ = torch.utils._pytree.tree_flatten(output.args[0])
        return [self._render(v) for v in flat]

    def _line(self, node: FlatNode, providers: bool) -> str:
        fx_node = self._by_name[node.name]
        parts = []
        for arg, value in self._named_args(fx_node):
            text = self._render(value)
            if self._is_value(value):
                parts.append(text + ("!" if text in node.mutates else ""))
            else:
                parts.append(f"{arg}={text}" if arg else text)
        call = f"{node.op}({', '.join(parts)})"
        lhs = ", ".join(node.outputs)
        line = f"{lhs} = {call}" if lhs else call
        if node.shapes:
            line += " -> " + ", ".join(node.shapes)
        notes = []
        if providers and node.kind == "contract":
            notes.append(f"{node.plugin}:{node.provider}" if node.plugin else node.provider)
        if node.layer is not None:
            notes.append(f"layer {node.layer}")
        return line + (f"  # {', '.join(notes)}" if notes else "")


def _named(chosen: Provider) -> Callable[..., Any]:
    """``chosen.fn`` under a name ``torch.fx`` code generation accepts (providers may be lambdas)."""
    fn = chosen.fn
    if getattr(fn, "__name__", "<lambda>").isidentifier():
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = re.sub(r"\W", "_", f"{chosen.op}__{chosen.name}")
    return call
