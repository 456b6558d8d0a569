"""Placement: several platforms at once, each node of a flat graph on one of them by a policy you write down.

::

    platforms = vllm_port.load_many(["cuda", "cpu"])                 # one Runtime per platform
    policy = PlacementPolicy.from_file("placement.toml")             # rules: by op, part, layers, node, weight
    placed = place(graph, policy, platforms)                         # PlacedGraph: transfers inserted, counted
    model = PlacedModel(llama, policy, platforms)                    # both phases, LM head, weights moved once
    llm = LLM(model_dir, placement="placement.toml", devices=["cuda", "cpu"])   # the engine

See docs/placement.md.
"""

from __future__ import annotations

from .parts import node_parts
from .placed_model import EnginePlacement, PlacedKVCache, PlacedModel
from .plan import PlacedGraph, place
from .platforms import Platforms, load_many
from .policy import PARTS, PlacementError, PlacementPolicy, PlacementRule, load_policy
from .transfers import Transfer, TransferStats
from .weights import WeightStore

__all__ = [
    "PARTS",
    "EnginePlacement",
    "PlacedGraph",
    "PlacedKVCache",
    "PlacedModel",
    "PlacementError",
    "PlacementPolicy",
    "PlacementRule",
    "Platforms",
    "Transfer",
    "TransferStats",
    "WeightStore",
    "load_many",
    "load_policy",
    "node_parts",
    "place",
]
