"""Each node's part of the decoder, read from the graph: what a rule's ``part = "mlp"`` selects.

:func:`node_parts` names every node of a flat graph ``embedding``, ``attention``, ``mlp``,
``norm`` or ``other`` (shape nodes: none), looking in this order at:

1. its op: ``embedding``; the cache and attention ops and rotary (attention); the gated
   activations (mlp); the RMSNorms, with the residual adds fused into them (norm);
2. what it reads: a layer's KV cache (attention), or a weight named as the flat models and Hugging
   Face checkpoints name MLP or attention weights (``gate_up_weight``, ``o_proj``...);
3. the parts of the nodes it reads, when they are all one of attention, mlp or norm: the views
   and adds between the projections of a part belong to it; anything else (what mixes parts,
   such as an unfused residual add) is ``other``.

The LM head is no node of these graphs: it is a node of its own, part ``lm_head``, of
:class:`~vllm_port.placement.PlacedModel`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..flat.flat_graph import KV_CACHE_OPS, FlatGraph, FlatNode

__all__ = ["ATTENTION_CACHE_OPS", "node_parts"]

#: The ops that read or write a layer's KV cache: they and the cache sit on one platform.
ATTENTION_CACHE_OPS = KV_CACHE_OPS
_ATTENTION_OPS = {*ATTENTION_CACHE_OPS, "rotary_embedding"}
_MLP_OPS = {"silu_and_mul", "gelu_and_mul"}
_NORM_OPS = {"rms_norm", "fused_add_rms_norm"}
#: Weight names by role, as the flat models and Hugging Face checkpoints spell them.
_MLP_WEIGHT = re.compile(r"mlp|gate|up_proj|down|ffn|fc\d|w[123]\b", re.IGNORECASE)
_ATTENTION_WEIGHT = re.compile(r"attn|attention|qkv|[qkvo]_proj|o_weight|o_bias|wqkv|wo\b", re.IGNORECASE)
#: A layer's KV-cache input (``k_cache_3``), the layer its group.
CACHE_INPUT = re.compile(r"[kv]_cache_(\d+)")


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
    if node.op in _ATTENTION_OPS or any(CACHE_INPUT.fullmatch(v) for v in node.inputs):
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
