"""What ``vllm-port inspect MODEL_DIR --placement FILE`` shows: where every node runs and what crosses between platforms.

:func:`placement_report` reads a :class:`~vllm_port.placement.PlacedModel`; :func:`render` prints it
(per phase: a table of nodes with their platform, part and the rule that placed them; the transfers
with their edges, shapes and bytes per token; totals per direction), :func:`dumps` as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .placed_model import LM_HEAD, PlacedModel

__all__ = ["dumps", "placement_report", "render"]


def placement_report(placed: PlacedModel) -> dict[str, Any]:
    """Platforms, weights and KV caches per platform, and per phase its nodes, transfers and totals."""
    phases = {}
    for phase, graph in placed.graphs.items():
        flat = {n.name: n for n in graph.flat.nodes}
        nodes = []
        for name, platform in graph.assignment.items():
            node = flat[name]
            nodes.append(
                {
                    "name": name,
                    "op": node.op,
                    "kind": node.kind,
                    "part": graph.parts.get(name),
                    "layer": node.layer,
                    "platform": platform,
                    "provider": f"{node.plugin}:{node.provider}" if node.plugin else node.provider,
                    "rule": graph.rules[name],
                }
            )
        nodes.append(
            {
                "name": LM_HEAD,
                "op": "linear",
                "kind": "contract",
                "part": "lm_head",
                "layer": None,
                "platform": placed.head_platform,
                "provider": _who(placed._head_kernels.providers["linear"]),
                "rule": placed.head_rule,
            }
        )
        transfers = [t.to_json() for t in graph.transfers] + [t.to_json() for t in placed.head_transfers(phase)]
        phases[phase] = {
            "nodes": nodes,
            "transfers": transfers,
            "totals": _totals(transfers),
            "output_platform": graph.output_platform,
        }
    config = placed.model.config
    return {
        "architecture": getattr(config, "architecture", type(placed.model).__name__),
        "num_layers": config.num_layers,
        "dtype": str(placed.dtype).removeprefix("torch."),
        "platforms": list(placed.platforms),
        "engine_platform": placed.platforms.default.platform.name,
        "default": placed.default,
        "policy": placed.policy.to_json(),
        "weights_bytes": dict(placed.weights.bytes),
        "kv_cache_platforms": list(placed.layer_platforms),
        "lm_head_platform": placed.head_platform,
        "phases": phases,
    }


def _totals(transfers: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per direction: transfers per step, and bytes per token (per sampled row for the LM head's) where known."""
    totals: dict[str, dict[str, Any]] = {}
    for t in transfers:
        entry = totals.setdefault(f"{t['src']}->{t['dst']}", {"count": 0, "bytes_per_token": 0, "other": []})
        entry["count"] += 1
        if t["bytes_per_token"] is not None:
            entry["bytes_per_token"] += t["bytes_per_token"]
        else:
            entry["other"].append(t["bytes"])
    return totals


def dumps(report: dict[str, Any]) -> str:
    """The report as one JSON object."""
    return json.dumps(report, indent=2, default=str)


def render(report: dict[str, Any], model_dir: str = "") -> str:
    """The report as text."""
    weights = ", ".join(f"{p} {b / 2**20:,.1f} MiB" for p, b in report["weights_bytes"].items()) or "none"
    kv: dict[str, list[int]] = {}
    for layer, platform in enumerate(report["kv_cache_platforms"]):
        kv.setdefault(platform, []).append(layer)
    lines = [
        f"model: {model_dir or '?'} ({report['architecture']}, {report['num_layers']} layers, {report['dtype']})",
        f"platforms: {', '.join(report['platforms'])} (engine batch on {report['engine_platform']}; "
        f"unmatched nodes on {report['default']})",
        f"weights: {weights}",
        "kv caches: " + "; ".join(f"{p}: layers {_ranges(ls)}" for p, ls in kv.items()),
        f"lm head: {report['lm_head_platform']}",
    ]
    for phase, graph in report["phases"].items():
        lines += ["", f"== {phase}: where each node runs"]
        lines += _table(
            [("#", "node", "op", "part", "layer", "platform", "rule", "provider")]
            + [
                (
                    str(i),
                    n["name"],
                    n["op"],
                    str(n["part"]),
                    "-" if n["layer"] is None else str(n["layer"]),
                    n["platform"],
                    _rule(report["policy"], n["rule"]),
                    n["provider"],
                )
                for i, n in enumerate(graph["nodes"])
            ]
        )
        lines += ["", f"== {phase}: what crosses between platforms ({len(graph['transfers'])} transfers a step)"]
        if graph["transfers"]:
            lines += _table(
                [("transfer", "value", "from", "to", "src->dst", "shape", "bytes")]
                + [
                    (
                        t["name"],
                        t["value"],
                        t["producer"],
                        ", ".join(t["consumers"]) or "-",
                        f"{t['src']}->{t['dst']}",
                        t["shape"],
                        t["bytes"],
                    )
                    for t in graph["transfers"]
                ]
            )
        for direction, total in graph["totals"].items():
            extra = f" + {' + '.join(total['other'])}" if total["other"] else ""
            lines.append(
                f"total {direction}: {total['count']} transfers, {total['bytes_per_token']:,} bytes per token{extra}"
            )
    return "\n".join(lines)


def _who(provider: Any) -> str:
    return f"{provider.plugin}:{provider.name}" if provider.plugin else provider.name


def _rule(policy: dict[str, Any], rule: int | str) -> str:
    if not isinstance(rule, int):
        return rule
    label = policy["rules"][rule].get("label")
    return f"rule {rule}" + (f" ({label})" if label else "")


def _ranges(layers: Sequence[int]) -> str:
    spans: list[tuple[int, int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1] = (spans[-1][0], layer)
        else:
            spans.append((layer, layer))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1] for row in rows]
