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


Shape nodes (host-side size arithmetic) are not placed. Each node's role (``part``, which rules
select by) is read from the graph (:mod:`~vllm_port.placement.parts`); the LM head is a node of
:class:`~vllm_port.placement.PlacedModel`.

This module holds :func:`place` and what it returns; the steps live beside it:

- :mod:`.parts`: each node's part;
- :mod:`._assign`: each node's target by the policy, checks of the policy, each KV cache's target;
- :mod:`._rewrite`: the walk that rewrites the graph (transfers, weights, bound providers, write-backs);
- :mod:`._aliases`: views and in-place writes, read from the ops' schemas;
- :mod:`.transfers`: the transfer nodes, their counter and their description;
- :mod:`.weights`: weights moved once, within budgets;
- :mod:`.platforms`: the loaded platforms, targets and their devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..flat.flat_graph import FlatGraph, copy_module
from ..runtime import Runtime
from ._assign import FOLLOWS, assign_nodes, cache_homes, check_policy
from ._rewrite import GraphRewriter
from .parts import node_parts
from .platforms import Platforms, normal_target, run_on_device
from .policy import PlacementPolicy, load_policy
from .transfers import Transfer, TransferStats
from .weights import WeightStore

__all__ = ["PlacedGraph", "place"]


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
                node.target = run_on_device(node.target, on[node.name])
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
    num_layers = sum(1 for name in graph.input_names if name.startswith("k_cache_"))
    check_policy(policy, platforms, default, num_layers)
    weights = weights if weights is not None else WeightStore()
    stats = stats if stats is not None else TransferStats()

    module = copy_module(graph.module)
    named = graph.with_module(module, graph.fusions)  # the same node names, over the copy
    parts = node_parts(named)
    by_fx = {named.fx_node(n.name): n for n in named.nodes}
    chosen, rules = assign_nodes(named, policy, parts, default)
    caches = cache_homes(named, chosen, rules, policy, default, cache_platforms)
    rewriter = GraphRewriter(named, platforms, default, chosen, caches, weights, stats)
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
