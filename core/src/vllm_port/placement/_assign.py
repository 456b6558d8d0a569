"""Which target each node of a flat graph runs on, by the policy, and where each layer's KV cache lives.

The first rule whose selectors all match a node places it, else the default
(:func:`choose_target`); shape nodes (host-side size arithmetic) and views are not chosen here (a
view runs where the tensor it views lives, which only the rewrite knows). Before choosing, the
policy is checked against what is loaded (every target a loaded platform and one of its devices)
and against the model (no layer range past its layers); after, each layer's cache ops must sit on
one target, which holds that layer's cache, and a plugin's own node (made by its graph pass for
the default platform) must stay there. Every refusal is a :class:`PlacementError` naming the rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..flat.flat_graph import FlatGraph, FlatNode
from ._aliases import aliased_input
from .parts import ATTENTION_CACHE_OPS, CACHE_INPUT
from .platforms import Platforms, split_target
from .policy import PlacementError, PlacementPolicy, PlacementRule

__all__ = ["DEFAULT", "FOLLOWS", "assign_nodes", "cache_homes", "check_policy", "choose_target"]

#: How a node placed by no rule but by the view rule is recorded in ``PlacedGraph.rules``.
FOLLOWS = "view"
#: How a node no rule matched is recorded in ``PlacedGraph.rules``.
DEFAULT = "default"


def check_policy(policy: PlacementPolicy, platforms: Platforms, default: str, num_layers: int) -> None:
    """Refuse a target that is not loaded (or a device index it lacks) and a layer range past ``num_layers``."""
    _check_platforms(policy, platforms, default)
    _check_layers(policy, num_layers)


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


def choose_target(
    rules: Sequence[PlacementRule], node: FlatNode, part: str | None, default: str
) -> tuple[str, int | str]:
    """The target of the first rule matching ``node`` (of ``part``), and that rule's index; else the default."""
    weights = [v[1:] for v in node.inputs if v.startswith("$")]
    for rule in rules:
        if rule.matches(node.op, part, node.layer, node.name, weights):
            return rule.target, rule.index
    return default, DEFAULT


def assign_nodes(
    graph: FlatGraph, policy: PlacementPolicy, parts: Mapping[str, str | None], default: str
) -> tuple[dict[str, str], dict[str, int | str]]:
    """Node name -> its target, and -> the rule that chose it (its index, or :data:`DEFAULT`).

    Shape nodes and views are left out (see the module docstring).
    """
    chosen: dict[str, str] = {}
    rules: dict[str, int | str] = {}
    for node in graph.nodes:
        if node.kind == "shape" or aliased_input(graph.fx_node(node.name)) is not None:
            continue
        chosen[node.name], rules[node.name] = choose_target(policy.rules, node, parts[node.name], default)
        if node.kind == "plugin" and chosen[node.name] != default:
            raise PlacementError(
                f"node {node.name} ({node.op}) is plugin {node.plugin!r}'s own op, made by its graph pass for the "
                f"default platform {default!r}; {rule_text(policy, rules[node.name])} puts it on "
                f"{chosen[node.name]!r}. Place it on {default!r}, or build the graph with core's passes only"
            )
    return chosen, rules


def rule_text(policy: PlacementPolicy, rule: int | str) -> str:
    """How an error names what placed a node: the rule (index, label, file), or the default."""
    return policy.rules[rule].who if isinstance(rule, int) else "the default"


def cache_homes(
    graph: FlatGraph,
    chosen: Mapping[str, str],
    rules: Mapping[str, int | str],
    policy: PlacementPolicy,
    default: str,
    agreed: Mapping[str, str] | None,
) -> dict[str, str]:
    """KV-cache input -> its platform: the one of the nodes that read or write it, which must agree.

    ``agreed`` is what another phase's graph was placed with (the phases share the caches); a
    layer whose cache lands elsewhere here is refused.
    """
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        if node.name not in chosen:
            continue
        for value in node.inputs:
            if CACHE_INPUT.fullmatch(value):
                readers.setdefault(value, []).append(node.name)
    homes: dict[str, str] = {}
    for name in graph.input_names:
        match = CACHE_INPUT.fullmatch(name)
        if not match:
            continue
        layer = int(match.group(1))
        nodes = readers.get(name, [])
        where = {chosen[n] for n in nodes}
        if len(where) > 1:
            sitting = ", ".join(f"{n} on {chosen[n]!r} ({rule_text(policy, rules[n])})" for n in nodes)
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
