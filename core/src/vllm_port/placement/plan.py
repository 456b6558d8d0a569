"""Place every node of a flat graph on a platform, with the transfers between platforms inserted and counted.

:func:`place` reads a :class:`~vllm_port.flat.FlatGraph`, gives each node a platform by the policy
(first matching rule, else the default), and rewrites a copy of its ``torch.fx`` graph so that it
runs there:

- a contract node calls the provider its platform bound for the op (``Runtime.bind``);
- a weight is read from its copy on the node's platform, moved there once, at placement
  (:class:`WeightStore`; a weight read on two platforms has a copy on each);
- a value made on one platform and read on another crosses in a ``placement.transfer`` node,
  inserted once per value and destination (later readers there reuse the copy) and counted each
  step by direction and bytes (:class:`TransferStats`);
- views (``view``, ``split``, ...) move no data, so they run where the tensor they view lives
  and no rule places them;
- an in-place write on another platform than the written value's storage is followed, when other
  values view that storage, by a ``placement.write_back`` node (a counted transfer) that copies
  the result home, so every view sees it; a value nothing views just moves (its later readers
  fetch it from where it was written);
- the KV cache inputs of a layer live on the platform of the layer's attention nodes
  (``reshape_and_cache``, ``paged_attention``, ``prefill_attention``), which must agree;
- a rule may name another device of a platform (``cuda:1``): a target of its own, with the
  platform's kernels run with that device current, its own weight copies and KV caches, and
  device-to-device copies for transfers (a pipeline split in one process, docs/placement.md).

Shape nodes (host-side size arithmetic) are not placed. Each node's role (``part``) is read from the
graph: ``embedding``; ``attention`` (q/k/v and output projections, rotary, the cache and attention
ops, and what only they feed); ``mlp`` (the gate/up and down projections and the activation
between); ``norm`` (RMSNorms, with the residual adds fused into them); ``other`` (what mixes parts,
such as an unfused residual add); the LM head is a node of :class:`~vllm_port.placement.PlacedModel`.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..flat.graph import FlatGraph, FlatNode, contract_op, copy_module, node_kind, op_targets
from ..runtime import Runtime
from .platforms import Platforms, normal_target, split_target
from .policy import PlacementError, PlacementPolicy, PlacementRule, load_policy

__all__ = ["ATTENTION_CACHE_OPS", "PlacedGraph", "Transfer", "TransferStats", "WeightStore", "node_parts", "place"]

#: The ops that read or write a layer's KV cache: they and the cache sit on one platform.
ATTENTION_CACHE_OPS = ("reshape_and_cache", "paged_attention", "prefill_attention")
_ATTENTION_OPS = {*ATTENTION_CACHE_OPS, "rotary_embedding"}
_MLP_OPS = {"silu_and_mul", "gelu_and_mul"}
_NORM_OPS = {"rms_norm", "fused_add_rms_norm"}
#: Weight names by role, as the flat models and Hugging Face checkpoints spell them.
_MLP_WEIGHT = re.compile(r"mlp|gate|up_proj|down|ffn|fc\d|w[123]\b", re.IGNORECASE)
_ATTENTION_WEIGHT = re.compile(r"attn|attention|qkv|[qkvo]_proj|o_weight|o_bias|wqkv|wo\b", re.IGNORECASE)
_CACHE_INPUT = re.compile(r"[kv]_cache_(\d+)")
#: How a node placed by no rule but by the view rule is recorded in ``PlacedGraph.rules``.
FOLLOWS = "view"
DEFAULT = "default"


# ------------------------------------------------------------------------------------------------
# Counting transfers
# ------------------------------------------------------------------------------------------------


class TransferStats:
    """Transfers run, by direction (``(src, dst)`` platform names): how many and how many bytes.

    Every ``placement.transfer`` and ``placement.write_back`` call of a placed model adds one; the
    engine's steps add up until :meth:`reset`.
    """

    def __init__(self) -> None:
        self.by_direction: dict[tuple[str, str], list[int]] = {}

    def record(self, src: str, dst: str, nbytes: int) -> None:
        entry = self.by_direction.get((src, dst))
        if entry is None:
            self.by_direction[(src, dst)] = [1, nbytes]
        else:
            entry[0] += 1
            entry[1] += nbytes

    @property
    def count(self) -> int:
        """Transfers run in every direction together."""
        return sum(c for c, _ in self.by_direction.values())

    @property
    def bytes(self) -> int:
        """Bytes moved in every direction together."""
        return sum(b for _, b in self.by_direction.values())

    def reset(self) -> None:
        self.by_direction.clear()

    def to_json(self) -> dict[str, dict[str, int]]:
        """``{"cpu->cuda": {"count": N, "bytes": B}, ...}``."""
        return {f"{s}->{d}": {"count": c, "bytes": b} for (s, d), (c, b) in sorted(self.by_direction.items())}


def _transfer_function(devices: Mapping[str, torch.device], stats: TransferStats) -> Callable[..., torch.Tensor]:
    def transfer(x: torch.Tensor, *, src: str, dst: str) -> torch.Tensor:
        stats.record(src, dst, x.nelement() * x.element_size())
        # a copy even between two platforms on one device, so that a placement tested on one host
        # moves data exactly as it would between two devices
        return x.to(devices[dst], copy=True)

    transfer.__module__, transfer.__name__, transfer.__qualname__ = "placement", "transfer", "transfer"
    return transfer


def _write_back_function(stats: TransferStats) -> Callable[..., torch.Tensor]:
    def write_back(home: torch.Tensor, written: torch.Tensor, *, src: str, dst: str) -> torch.Tensor:
        stats.record(src, dst, written.nelement() * written.element_size())
        return home.copy_(written)

    write_back.__module__, write_back.__name__, write_back.__qualname__ = "placement", "write_back", "write_back"
    return write_back


def _on_device(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` called with ``device`` the current device of its type (restored after)."""
    module = torch.get_device_module(device.type)

    def on_device(*args: Any, **kwargs: Any) -> Any:
        with module.device(device.index):
            return fn(*args, **kwargs)

    # a plain name for fx's code generation, as the transfer nodes have
    on_device.__module__, on_device.__name__, on_device.__qualname__ = "placement", "on_device", "on_device"
    return on_device


def device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made current where it is a non-zero accelerator device (its kernels launch there); else nothing."""
    if device.type == "cpu" or not device.index:
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device.index)


# ------------------------------------------------------------------------------------------------
# Weights moved once
# ------------------------------------------------------------------------------------------------


class WeightStore:
    """Each weight's copy on each platform, made once (``tensor.to(device)``: no copy where it already lives).

    Shared by the graphs of one model (decode, prefill, the LM head), so a weight moves once.

    :param budgets: platform -> the most bytes of weights it may hold; a move past it is refused
        before it happens (:class:`PlacementError`).
    """

    def __init__(self, budgets: Mapping[str, int] | None = None) -> None:
        self._copies: dict[tuple[int, str], torch.Tensor] = {}
        self._keep: dict[int, torch.Tensor] = {}  # the originals, so ids stay unique while copies live
        self.budgets = dict(budgets or {})
        self.bytes: dict[str, int] = {}

    def get(self, weight: torch.Tensor, platform: str, device: torch.device, name: str = "") -> torch.Tensor:
        """``weight`` (called ``name`` in messages) on ``platform`` (its device ``device``)."""
        key = (id(weight), platform)
        found = self._copies.get(key)
        if found is None:
            size = weight.nelement() * weight.element_size()
            budget = self.budgets.get(platform)
            if budget is not None and self.bytes.get(platform, 0) + size > budget:
                raise PlacementError(
                    f"platform {platform!r}: weight {name or tuple(weight.shape)} ({size:,} bytes) would bring its "
                    f"weights to {self.bytes.get(platform, 0) + size:,} bytes, over its budget of {budget:,}; "
                    "place more of the model elsewhere (e.g. a rule with part = 'mlp' on the host platform)"
                )
            found = weight.to(device)
            self._copies[key] = found
            self._keep[id(weight)] = weight
            self.bytes[platform] = self.bytes.get(platform, 0) + size
        return found

    def tensors(self) -> list[torch.Tensor]:
        """Every weight copy held, on every platform (a weight already where it runs is its own copy)."""
        return list(self._copies.values())


# ------------------------------------------------------------------------------------------------
# The placed graph
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One transfer node of a placed graph: which value crosses, from where to where, and its size.

    Attributes:
        name: the node's name in the placed graph (``transfer_3``).
        kind: ``"transfer"`` (a copy for a reader) or ``"write_back"`` (an in-place write copied home).
        value: the value that crosses (``%linear_3``, ``block_tables``).
        producer: the node that made it, or the graph input it is.
        consumers: the nodes on ``dst`` that read the copy.
        src, dst: the platforms.
        shape: the value's shape and dtype (``[num_seqs, 128] f32``).
        bytes: its size per step as a formula of the batch (``512*num_seqs``).
        bytes_per_token: bytes per token of the step's batch, where the size is proportional to it.
    """

    name: str
    kind: str
    value: str
    producer: str
    consumers: tuple[str, ...]
    src: str
    dst: str
    shape: str
    bytes: str
    bytes_per_token: int | None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "consumers": list(self.consumers)}


@dataclass
class PlacedGraph:
    """A flat graph placed on platforms; call it like the graph (see the module docstring).

    Attributes:
        graph: the graph as given.
        flat: the placed graph: transfers inserted, contract nodes bound on their platforms.
        default: the default platform's name.
        assignment: node name -> platform, for every node but shape nodes.
        parts: node name -> its part (``mlp``...).
        rules: node name -> the index of the rule that placed it, ``"default"``, or ``"view"``.
        transfers: every transfer node, in execution order.
        cache_platforms: KV-cache input (``k_cache_3``) -> the platform it lives on.
        output_platform: where the graph's result is.
        stats: transfers counted at run time.
        devices: each target's torch device (a platform name, or ``NAME:INDEX`` for another of its devices).
    """

    graph: FlatGraph
    flat: FlatGraph
    default: str
    assignment: dict[str, str]
    parts: dict[str, str | None]
    rules: dict[str, int | str]
    transfers: list[Transfer]
    cache_platforms: dict[str, str]
    output_platform: str
    stats: TransferStats = field(default_factory=TransferStats)

    #: target -> its torch device, for targets whose kernels need their device made current (``cuda:1``)
    devices: dict[str, torch.device] = field(default_factory=dict)
    _runner: Any = field(default=None, repr=False)

    def __call__(self, *args: Any) -> Any:
        """Run the placed graph eagerly (inputs as ``flat.graph_inputs`` builds them, each cache on its platform)."""
        if self._runner is None:
            self._runner = self._eager_module()
        return self._runner(*args)

    def _eager_module(self) -> Any:
        """``flat``'s eager module, each node of a non-zero accelerator device run with that device current.

        Kernels that launch on the current device (Triton's do) would otherwise run device 1's
        nodes on device 0; torch's own ops follow their tensors and need nothing.
        """
        module = self.flat.eager_module()
        switched = {t: d for t, d in self.devices.items() if d.type != "cpu" and d.index}
        if not switched:
            return module
        on = {self.flat.fx_node(name).name: switched[t] for name, t in self.assignment.items() if t in switched}
        for node in module.graph.nodes:
            if node.op == "call_function" and node.name in on:
                node.target = _on_device(node.target, on[node.name])
        module.recompile()
        return module

    def cut_edges(self) -> dict[tuple[str, str], int]:
        """Transfers planned per step, by direction: ``{("cpu", "cuda"): 2, ...}``."""
        found: dict[tuple[str, str], int] = {}
        for t in self.transfers:
            found[(t.src, t.dst)] = found.get((t.src, t.dst), 0) + 1
        return found

    def platform_nodes(self) -> dict[str, int]:
        """How many nodes run on each platform."""
        found: dict[str, int] = {}
        for platform in self.assignment.values():
            found[platform] = found.get(platform, 0) + 1
        return found


# ------------------------------------------------------------------------------------------------
# Parts
# ------------------------------------------------------------------------------------------------


def _producer(value: str) -> str | None:
    """``%split.1`` -> ``split``; graph inputs and weights have no producer node."""
    return value[1:].split(".", 1)[0] if value.startswith("%") else None


def node_parts(graph: FlatGraph) -> dict[str, str | None]:
    """Node name -> its part in the decoder (see the module docstring); ``None`` for shape nodes."""
    parts: dict[str, str | None] = {}
    for node in graph.nodes:
        parts[node.name] = None if node.kind == "shape" else _part(node, parts)
    return parts


def _part(node: FlatNode, parts: Mapping[str, str | None]) -> str:
    if node.op == "embedding":
        return "embedding"
    if node.op in _ATTENTION_OPS or any(_CACHE_INPUT.fullmatch(v) for v in node.inputs):
        return "attention"
    if node.op in _MLP_OPS:
        return "mlp"
    if node.op in _NORM_OPS:
        return "norm"
    for value in node.inputs:
        if value.startswith("$"):
            if _MLP_WEIGHT.search(value):
                return "mlp"
            if _ATTENTION_WEIGHT.search(value):
                return "attention"
    found = {parts.get(p) for v in node.inputs if (p := _producer(v)) is not None and parts.get(p) is not None}
    if len(found) == 1:
        (only,) = found
        return only if only in ("attention", "mlp", "norm") else "other"
    return "other"


# ------------------------------------------------------------------------------------------------
# Assigning platforms
# ------------------------------------------------------------------------------------------------


def _aliased_input(node: fx.Node) -> fx.Node | None:
    """The input ``node``'s output is a view of (``view``, ``split``, ``getitem`` of a split), else ``None``."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        base = node.args[0]
        return base if isinstance(base, fx.Node) and _is_tensor_list(base) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return None
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and not info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def _is_tensor(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def _is_tensor_list(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)


def _written_args(node: fx.Node) -> list[fx.Node]:
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written


def _check_platforms(policy: PlacementPolicy, platforms: Platforms, default: str) -> None:
    where = f" of {policy.source}" if policy.source else ""
    name, index = split_target(default)
    if name not in platforms:
        raise PlacementError(
            f"placement policy{where}: default platform {default!r} is not loaded (loaded: {', '.join(platforms)}); "
            f"load it, e.g. devices=[{name!r}, ...], or name a loaded platform"
        )
    if index >= platforms.device_count(name):
        raise PlacementError(
            f"placement policy{where}: default {default!r}: platform {name!r} has "
            f"{platforms.device_count(name)} device(s) here; name an index below that"
        )
    for rule in policy.rules:
        if rule.platform_name not in platforms:
            raise PlacementError(
                f"{rule.who}: platform {rule.platform!r} is not loaded (loaded: {', '.join(platforms)}); "
                f"load it too, e.g. LLM(devices=[..., {rule.platform_name!r}]) or vllm_port.load_many([...]), "
                "or fix the name"
            )
        count = platforms.device_count(rule.platform_name)
        if split_target(rule.target)[1] >= count:
            raise PlacementError(
                f"{rule.who}: platform {rule.platform!r}: {rule.platform_name!r} has {count} device(s) here "
                f"(indices 0-{count - 1}); name one of them, or run where that device exists"
            )


def _check_layers(policy: PlacementPolicy, num_layers: int) -> None:
    for rule in policy.rules:
        if rule.layers is not None and rule.layers[1] >= num_layers:
            first, last = rule.layers
            raise PlacementError(
                f"{rule.who}: layers {first}-{last} reach past the model's {num_layers} layers "
                f"(0-{num_layers - 1}); lower the last layer"
            )


def _choose(rules: Sequence[PlacementRule], node: FlatNode, part: str | None, default: str) -> tuple[str, int | str]:
    weights = [v[1:] for v in node.inputs if v.startswith("$")]
    for rule in rules:
        if rule.matches(node.op, part, node.layer, node.name, weights):
            return rule.target, rule.index
    return default, DEFAULT


# ------------------------------------------------------------------------------------------------
# place
# ------------------------------------------------------------------------------------------------


def place(
    graph: FlatGraph,
    policy: PlacementPolicy | Mapping[str, Any] | Sequence[Any] | str | None,
    platforms: Platforms | Runtime,
    *,
    weights: WeightStore | None = None,
    stats: TransferStats | None = None,
    cache_platforms: Mapping[str, str] | None = None,
) -> PlacedGraph:
    """Place every node of ``graph`` on one of ``platforms`` by ``policy`` (see the module docstring).

    :param policy: a :class:`PlacementPolicy`, a mapping or list of rules, a ``.toml``/``.json``
        file, or ``None`` (every node on the default platform).
    :param weights: where moved weights are kept (share one between the graphs of a model).
    :param stats: the counter the transfer nodes add to (default: a new one, ``PlacedGraph.stats``).
    :param cache_platforms: the KV-cache platforms another phase's graph was placed with; this
        graph's must agree (the caches are shared).
    :raises PlacementError: for a platform that is not loaded, a layer range past the model, a
        layer whose attention nodes sit on different platforms, or a plugin node moved off its platform.
    """
    policy = load_policy(policy)
    platforms = Platforms.of(platforms)
    default = normal_target(policy.default) if policy.default else platforms.default.platform.name
    _check_platforms(policy, platforms, default)
    num_layers = sum(1 for name in graph.input_names if name.startswith("k_cache_"))
    _check_layers(policy, num_layers)
    weights = weights if weights is not None else WeightStore()
    stats = stats if stats is not None else TransferStats()

    module = copy_module(graph.module)
    named = graph.with_module(module, graph.fusions)  # the same node names, over the copy
    parts = node_parts(named)
    by_fx = {named.fx_node(n.name): n for n in named.nodes}
    chosen: dict[str, str] = {}
    rules: dict[str, int | str] = {}
    for node in named.nodes:
        if node.kind == "shape" or _aliased_input(named.fx_node(node.name)) is not None:
            continue
        chosen[node.name], rules[node.name] = _choose(policy.rules, node, parts[node.name], default)
        if node.kind == "plugin" and chosen[node.name] != default:
            raise PlacementError(
                f"node {node.name} ({node.op}) is plugin {node.plugin!r}'s own op, made by its graph pass for the "
                f"default platform {default!r}; {_rule_text(policy, rules[node.name])} puts it on "
                f"{chosen[node.name]!r}. Place it on {default!r}, or build the graph with core's passes only"
            )
    caches = _cache_homes(named, chosen, rules, policy, default, cache_platforms)
    rewriter = _Rewriter(named, platforms, default, chosen, caches, weights, stats)
    rewriter.run()
    for fx_node, platform in rewriter.view_platforms.items():
        flat_node = by_fx.get(fx_node)
        if flat_node is not None:
            chosen[flat_node.name], rules[flat_node.name] = platform, FOLLOWS
    placed_flat = rewriter.flat_graph()
    order = {n.name: i for i, n in enumerate(named.nodes)}
    assignment = {name: chosen[name] for name in sorted(chosen, key=order.__getitem__)}
    return PlacedGraph(
        graph=graph,
        flat=placed_flat,
        default=default,
        assignment=assignment,
        parts={n.name: parts[n.name] for n in named.nodes if n.kind != "shape"},
        rules={name: rules[name] for name in assignment},
        transfers=rewriter.transfers(placed_flat),
        cache_platforms=caches,
        output_platform=rewriter.output_platform,
        stats=stats,
        devices=dict(rewriter.devices),
    )


def _rule_text(policy: PlacementPolicy, rule: int | str) -> str:
    return policy.rules[rule].who if isinstance(rule, int) else "the default"


def _cache_homes(
    graph: FlatGraph,
    chosen: Mapping[str, str],
    rules: Mapping[str, int | str],
    policy: PlacementPolicy,
    default: str,
    agreed: Mapping[str, str] | None,
) -> dict[str, str]:
    """KV-cache input -> its platform: the one of the nodes that read or write it, which must agree."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.name not in chosen:
            continue
        for value in node.inputs:
            if _CACHE_INPUT.fullmatch(value):
                readers.setdefault(value, []).append(node.name)
    homes: dict[str, str] = {}
    for name in graph.input_names:
        match = _CACHE_INPUT.fullmatch(name)
        if not match:
            continue
        layer = int(match.group(1))
        nodes = readers.get(name, [])
        where = {chosen[n] for n in nodes}
        if len(where) > 1:
            sitting = ", ".join(f"{n} on {chosen[n]!r} ({_rule_text(policy, rules[n])})" for n in nodes)
            raise PlacementError(
                f"layer {layer}'s KV cache is read and written by nodes on different platforms: {sitting}; "
                f"the cache lives on one platform, so {', '.join(ATTENTION_CACHE_OPS)} of a layer must sit together. "
                f"Place them with one rule, e.g. part = 'attention', layers = '{layer}'"
            )
        homes[name] = where.pop() if where else default
        if agreed is not None and name in agreed and agreed[name] != homes[name]:
            raise PlacementError(
                f"layer {layer}'s KV cache {name} is on {agreed[name]!r} for one phase and on {homes[name]!r} for the "
                f"{graph.phase} graph ({', '.join(nodes)}); prefill and decode share the cache, so place the "
                "layer's attention by part or layers, not by node names of one phase"
            )
    return homes


class _Rewriter:
    """Rewrites the copied fx graph in place: transfers, moved weights, retargeted contract nodes."""

    def __init__(
        self,
        graph: FlatGraph,
        platforms: Platforms,
        default: str,
        chosen: Mapping[str, str],
        caches: Mapping[str, str],
        weights: WeightStore,
        stats: TransferStats,
    ) -> None:
        self.graph, self.module, self.fx = graph, graph.module, graph.module.graph
        self.platforms, self.default, self.weights = platforms, default, weights
        # every target in use: each platform (its device 0) and each other device a rule names (cuda:1)
        used = [*platforms, *(t for t in (*chosen.values(), *caches.values(), default) if t not in platforms)]
        self.devices = {target: platforms.device(target) for target in dict.fromkeys(used)}
        self.chosen = {graph.fx_node(name): p for name, p in chosen.items()}
        self.caches = caches
        dtype = graph.kernels.context.dtype if graph.kernels is not None else torch.float32
        bound = {name: op_targets(platforms[name].bind(dtype)) for name in platforms}  # one binding per platform
        self.targets = {target: bound[split_target(target)[0]] for target in self.devices}
        self.transfer = _transfer_function(self.devices, stats)
        self.write_back = _write_back_function(stats)
        self.copies: dict[fx.Node, dict[str, fx.Node]] = {}
        self.home: dict[fx.Node, str] = {}
        self.view_platforms: dict[fx.Node, str] = {}
        self.consumers: dict[fx.Node, list[fx.Node]] = {}
        self.moved: dict[tuple[str, str], fx.Node] = {}
        self.weight_names: dict[str, str] = {}
        self.groups = self._alias_groups()
        self.output_platform = default

    # --- alias groups: values sharing storage in the original program ---

    def _alias_groups(self) -> dict[fx.Node, list[fx.Node]]:
        parent: dict[fx.Node, fx.Node] = {}

        def find(n: fx.Node) -> fx.Node:
            while parent.get(n, n) is not n:
                n = parent[n]
            return n

        for node in self.fx.nodes:
            base = _aliased_input(node)
            if base is not None:
                parent[find(node)] = find(base)
        members: dict[fx.Node, list[fx.Node]] = {}
        for node in self.fx.nodes:
            members.setdefault(find(node), []).append(node)
        return {node: members[find(node)] for node in self.fx.nodes}

    # --- the walk ---

    def run(self) -> None:
        placeholders = [n for n in self.fx.nodes if n.op == "placeholder"]
        engine = self.platforms.default.platform.name  # the batch's inputs come from the engine's platform
        for node, name in zip(placeholders, self.graph.input_names, strict=False):
            platform = self.caches.get(name, engine)
            self.home[node], self.copies[node] = platform, {platform: node}
        for node in list(self.fx.nodes):
            if node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                self._call(node)
        for node in [n for n in self.fx.nodes if n.op == "get_attr" and not n.users]:
            self.fx.erase_node(node)

    def _call(self, node: fx.Node) -> None:
        base = _aliased_input(node)
        if base is not None:  # a view runs where what it views lives
            platform = self.home.get(base, self.default)
            self.view_platforms[node] = platform
        elif node in self.chosen:
            platform = self.chosen[node]
        else:  # a shape node: sizes on the host, nothing moves
            return
        written = [a for a in _written_args(node) if _is_tensor(a)]
        node.args = fx.map_arg(node.args, lambda a: self._read(a, node, platform))
        node.kwargs = fx.map_arg(node.kwargs, lambda a: self._read(a, node, platform))
        if "device" in node.kwargs and node_kind(node) == "native":  # a factory traced on the host
            node.kwargs = {**node.kwargs, "device": self.devices[platform]}
        op = contract_op(node)
        if op is not None:
            node.target = self.targets[platform][op]
        self.home[node], self.copies[node] = platform, {platform: node}
        if written:
            self._written(written, platform, node)

    def _read(self, arg: fx.Node, node: fx.Node, platform: str) -> fx.Node:
        if arg.op == "get_attr":
            return self._weight(arg, platform, node)
        if not _is_tensor(arg) and not _is_tensor_list(arg):
            return arg  # sizes, ints
        copies = self.copies.get(arg)
        if copies is None:
            return arg
        found = copies.get(platform)
        if found is None:
            src = self.home[arg] if self.home[arg] in copies else next(iter(copies))
            with self.fx.inserting_before(node):
                found = self.fx.call_function(self.transfer, (copies[src],), {"src": src, "dst": platform})
            found.meta["val"] = arg.meta.get("val")
            found.meta["placement_value"] = arg
            copies[platform] = found
        if found.meta.get("placement_value") is arg:
            self.consumers.setdefault(found, []).append(node)
        return found

    def _written(self, written: Sequence[fx.Node], platform: str, cursor: fx.Node) -> None:
        """``written`` were written in place on ``platform``: drop stale copies, copy home where views need it."""
        fresh = {value: self.copies[value][platform] for value in written}
        viewed = []
        for value in written:
            group = self.groups.get(value, [value])
            if len(group) == 1:  # nothing views it: it now lives where it was written
                self.copies[value] = {platform: fresh[value]}
                continue
            home = self.home[value]
            if home != platform:
                viewed.append(value)
                with self.fx.inserting_after(cursor):
                    cursor = self.fx.call_function(
                        self.write_back, (value, fresh[value]), {"src": platform, "dst": home}
                    )
                cursor.meta["val"] = value.meta.get("val")
                cursor.meta["placement_value"] = value
                self.consumers[cursor] = []
            # the storage changed: every view of it is fresh at home only (conservative: copies elsewhere go)
            for member in group:
                if member in self.copies:
                    self.copies[member] = {self.home[member]: member}
        for value in viewed:
            self.copies[value][platform] = fresh[value]

    def _weight(self, attr: fx.Node, platform: str, node: fx.Node) -> fx.Node:
        key = (str(attr.target), platform)
        found = self.moved.get(key)
        if found is None:
            tensor = getattr(self.module, str(attr.target))
            name = self.graph.weight_names.get(str(attr.target), str(attr.target))
            target = re.sub(r"\W", "_", f"{attr.target}__{platform}")
            moved = self.weights.get(tensor, platform, self.devices[platform], name)
            self.module.register_buffer(target, moved, persistent=False)
            with self.fx.inserting_before(attr):
                found = self.fx.get_attr(target)
            found.meta.update(attr.meta)
            self.moved[key], self.weight_names[target] = found, name
        return found

    def _output(self, node: fx.Node) -> None:
        where: list[str] = []

        def pick(arg: fx.Node) -> fx.Node:
            copies = self.copies.get(arg)
            if not copies:
                return arg
            platform = self.home[arg] if self.home[arg] in copies else next(iter(copies))
            where.append(platform)
            return copies[platform]

        node.args = fx.map_arg(node.args, pick)
        if where:
            self.output_platform = where[0]

    # --- results ---

    def flat_graph(self) -> FlatGraph:
        module = fx.GraphModule(self.module, self.fx)  # holds only the attributes the graph reads: the moved weights
        module.meta.update(self.module.meta)
        return FlatGraph(
            module,
            phase=self.graph.phase,
            input_names=self.graph.input_names,
            weight_names=self.weight_names,
            symbol_names=self.graph.symbol_names,
            kernels=self.graph.kernels,
            fusions=self.graph.fusions,
        )

    def transfers(self, placed: FlatGraph) -> list[Transfer]:
        names = {placed.fx_node(n.name): n for n in placed.nodes}
        found = []
        token = self._token_symbol()
        for node in self.fx.nodes:
            value = node.meta.get("placement_value")
            if value is None or node not in names:
                continue
            flat = names[node]
            text, per_token = _bytes(node.meta.get("val"), placed.symbol_names, token)
            src, dst = node.kwargs["src"], node.kwargs["dst"]
            producer = self._value_name(placed, value)
            found.append(
                Transfer(
                    name=flat.name,
                    kind="write_back" if node.target is self.write_back else "transfer",
                    value=self._value_text(value, producer),
                    producer=producer,
                    consumers=tuple(names[c].name for c in self.consumers.get(node, []) if c in names),
                    src=src,
                    dst=dst,
                    shape=flat.shapes[0] if flat.shapes else "",
                    bytes=text,
                    bytes_per_token=per_token,
                )
            )
        return found

    def _value_name(self, placed: FlatGraph, value: fx.Node) -> str:
        if value.op == "placeholder":
            placeholders = [n for n in self.fx.nodes if n.op == "placeholder"]
            return self.graph.input_names[placeholders.index(value)]
        for flat in placed.nodes:
            if placed.fx_node(flat.name) is value:
                return flat.name
        base = value.args[0] if value.target is operator.getitem else value
        for flat in placed.nodes:
            if placed.fx_node(flat.name) is base:
                return flat.name
        return value.name

    @staticmethod
    def _value_text(value: fx.Node, producer: str) -> str:
        if value.op == "placeholder":
            return producer
        if value.target is operator.getitem:
            return f"%{producer}.{value.args[1]}"
        return f"%{producer}"

    def _token_symbol(self) -> Any:
        first = next(n for n in self.fx.nodes if n.op == "placeholder")  # input_ids: [num_tokens]
        size = first.meta["val"].shape[0]
        return size.node.expr if isinstance(size, torch.SymInt) else None


def _bytes(val: Any, symbol_names: Mapping[str, str], token: Any) -> tuple[str, int | None]:
    """The bytes of ``val`` as a formula of the batch (``512*num_seqs``), and per token where proportional to it."""
    if not isinstance(val, torch.Tensor):
        return "0", None
    numel: Any = val.element_size()
    for size in val.shape:
        numel = numel * (size.node.expr if isinstance(size, torch.SymInt) else int(size))
    if isinstance(numel, int):
        return str(numel), None
    text = str(numel)
    for symbol in sorted(numel.free_symbols, key=lambda s: -len(str(s))):
        text = re.sub(rf"\b{re.escape(str(symbol))}\b", symbol_names.get(str(symbol), str(symbol)), text)
    per_token = None
    if token is not None and numel.free_symbols == {token}:
        ratio = numel / token
        if ratio.is_number and float(ratio) == math.floor(float(ratio)):
            per_token = int(ratio)
    return text.replace("*", "·"), per_token
