"""What ``vllm-port inspect`` shows: a model's flat graph with each node's op, provider, shapes and layer.

:func:`inspect_graphs` traces a loaded model on a runtime, runs the fusion passes (core's and the
plugins') and reports each phase's nodes, the counts of contract and native nodes, and the times
each fusion fired; :func:`render` prints it as a table (or the graph's stable text form).
The command (``inspect_command.py``) loads the model; this module never reads a model directory itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from .flat_graph import FlatGraph
from .passes import apply_passes
from .trace import PHASES, trace

__all__ = ["dumps", "graph_report", "inspect_graphs", "render"]


def graph_report(graph: FlatGraph) -> dict[str, Any]:
    """One phase's report: ``nodes`` (kernels: contract, native and plugin nodes), ``counts``, ``fusions``, ``text``.

    Shape nodes (host-side size arithmetic of the symbolic batch) are counted, not listed.
    """
    nodes = [n.to_json() for n in graph.nodes if n.kind != "shape"]
    return {
        "phase": graph.phase,
        "nodes": nodes,
        "counts": graph.counts(),
        "fusions": dict(graph.fusions),
        "providers": graph.providers(),
        "digest": graph.digest(),
        "text": graph.text(),
    }


def inspect_graphs(
    model: Any,
    runtime: Any,
    dtype: torch.dtype,
    phases: Sequence[str] = PHASES,
    passes: bool = True,
    block_size: int = 16,
) -> dict[str, Any]:
    """The report of ``model`` on ``runtime``: the first phase's graph at the top level, every phase under ``graphs``.

    The top level holds ``nodes``, ``counts`` and ``fusions`` of ``phases[0]`` (decode by default),
    beside the platform, dtype and model facts.
    """
    kernels = runtime.bind(dtype)
    graphs = {}
    for phase in phases:
        graph = trace(model, kernels, phase=phase, block_size=block_size)
        graphs[phase] = graph_report(apply_passes(graph, runtime) if passes else graph)
    config = model.config
    first = graphs[phases[0]]
    return {
        "architecture": getattr(config, "architecture", type(model).__name__),
        "num_layers": config.num_layers,
        "platform": runtime.platform.name,
        "dtype": str(dtype).removeprefix("torch."),
        "phase": phases[0],
        "nodes": first["nodes"],
        "counts": first["counts"],
        "fusions": first["fusions"],
        "providers": first["providers"],
        "graphs": graphs,
    }


def dumps(report: dict[str, Any]) -> str:
    """The report as one JSON object (the text forms left out of the per-phase entries: they repeat the nodes)."""
    slim = {**report, "graphs": {p: {k: v for k, v in g.items() if k != "text"} for p, g in report["graphs"].items()}}
    return json.dumps(slim, indent=2, default=str)


def render(report: dict[str, Any], model_dir: str = "", graph_text: bool = False) -> str:
    """The report as text: per phase, a table of nodes (or the graph's text form), counts and fusions."""
    lines = [
        f"model: {model_dir or '?'} ({report['architecture']}, {report['num_layers']} layers)  "
        f"platform: {report['platform']}  dtype: {report['dtype']}"
    ]
    for phase, graph in report["graphs"].items():
        lines.append("")
        lines.append(f"== {phase} graph ({graph['digest'][:12]})")
        if graph_text:
            lines.append(graph["text"])
        else:
            lines += _table(graph["nodes"])
        counts = graph["counts"]
        lines.append(
            f"counts: {counts['contract']} contract, {counts['native']} native"
            + (f", {counts['plugin']} plugin" if counts.get("plugin") else "")
            + (f" ({counts['shape']} shape nodes, host-side size arithmetic)" if counts.get("shape") else "")
        )
        fired = ", ".join(f"{name} x{n}" for name, n in graph["fusions"].items()) or "none run"
        lines.append(f"fusions: {fired}")
    return "\n".join(lines)


def _table(nodes: Sequence[dict[str, Any]]) -> list[str]:
    rows = [("#", "node", "op", "kind", "provider", "layer", "shapes")]
    for i, node in enumerate(nodes):
        provider = f"{node['plugin']}:{node['provider']}" if node["plugin"] else node["provider"]
        layer = "-" if node["layer"] is None else str(node["layer"])
        shapes = ", ".join(node["shapes"]) or "writes " + ", ".join(node["mutates"])  # in-place ops return nothing
        rows.append((str(i), node["name"], node["op"], node["kind"], provider, layer, shapes))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]
