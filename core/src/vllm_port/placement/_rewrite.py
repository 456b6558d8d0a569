"""The rewrite that makes a flat graph run on its targets: one walk over a copy of its ``torch.fx`` graph.

Given each node's target (``_assign``) and each KV cache's, :class:`GraphRewriter` walks the
nodes in order and, for each:

- a contract node calls the provider its target's platform bound for the op (one binding per platform);
- a weight is read from its copy on the node's target (:class:`~vllm_port.placement.WeightStore`,
  registered on the module as a buffer named ``WEIGHT__TARGET``);
- a value read on another target than where it is gets a ``placement.transfer`` node, once per
  value and destination: later readers there reuse the copy;
- a view runs where the tensor it views lives (moving no data); a factory's ``device=`` is
  pointed at the node's target;
- an in-place write away from the written value's storage: a value nothing views simply moves
  (its next reader elsewhere fetches it from where it was written); one that shares storage with
  others is copied home by a ``placement.write_back`` node so that every view sees the write.

It tracks, per value, its home (where it was made) and its fresh copies by target. Afterwards it
gives the placed :class:`~vllm_port.flat.FlatGraph` and the :class:`~vllm_port.placement.Transfer`
list that describes its transfer nodes.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from ..flat.flat_graph import FlatGraph, contract_op, node_kind, op_targets
from ._aliases import aliased_input, is_tensor, is_tensor_list, written_args
from .platforms import Platforms, split_target
from .transfers import Transfer, TransferStats, bytes_formula, transfer_function, write_back_function
from .weights import WeightStore

__all__ = ["GraphRewriter"]


class GraphRewriter:
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
        self.transfer = transfer_function(self.devices, stats)
        self.write_back = write_back_function(stats)
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
            base = aliased_input(node)
            if base is not None:
                parent[find(node)] = find(base)
        members: dict[fx.Node, list[fx.Node]] = {}
        for node in self.fx.nodes:
            members.setdefault(find(node), []).append(node)
        return {node: members[find(node)] for node in self.fx.nodes}

    # --- the walk ---

    def run(self) -> None:
        """Rewrite the graph in place: inputs at home, then every node in order (see the module docstring)."""
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
        base = aliased_input(node)
        if base is not None:  # a view runs where what it views lives
            platform = self.home.get(base, self.default)
            self.view_platforms[node] = platform
        elif node in self.chosen:
            platform = self.chosen[node]
        else:  # a shape node: sizes on the host, nothing moves
            return
        written = [a for a in written_args(node) if is_tensor(a)]
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
        if not is_tensor(arg) and not is_tensor_list(arg):
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
        """The rewritten graph as a :class:`FlatGraph` (the same node names, the moved weights' names)."""
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
        """Every transfer and write-back node of ``placed`` (what :meth:`flat_graph` made), in execution order."""
        names = {placed.fx_node(n.name): n for n in placed.nodes}
        found = []
        token = self._token_symbol()
        for node in self.fx.nodes:
            value = node.meta.get("placement_value")
            if value is None or node not in names:
                continue
            flat = names[node]
            text, per_token = bytes_formula(node.meta.get("val"), placed.symbol_names, token)
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
