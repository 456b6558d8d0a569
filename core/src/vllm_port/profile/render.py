"""A profile and a baseline comparison as readable text: one section per phase, then graph, memory and comm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render", "render_comparison"]


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.1f} ms"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.2f} ms"
    return f"{value:.1f} us"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


def _who(entry: Mapping[str, Any]) -> str:
    return f"{entry['plugin']}:{entry['provider']}" if entry["plugin"] else entry["provider"]


def render(report: Mapping[str, Any], all_nodes: bool = False, top: int = 10) -> str:
    """The profile as text: per phase the step, stack layers, ops by provider, model layers and the slowest nodes."""
    model = report["model"]
    shape = report["shape"]
    importer = report.get("importer")  # absent from profiles written before imported models were profiled
    built = f", imported by {importer!r}" if importer else ""
    lines = [
        f"profile: {report['model_dir'] or '?'} ({model['architecture']}, {model['num_layers']} layers{built})  "
        f"platform: {report['platform']} ({report['device']})  dtype: {report['dtype']}",
        f"batch {shape['batch']} x context {shape['context']}, {report['repeats']} profiled steps per phase "
        f"(node times are medians); {report['timer_note']}",
    ]
    for phase, p in report["phases"].items():
        lines += ["", *_phase(phase, p, all_nodes, top)]
    lines += ["", *_graph(report["groups"]["graph"]), "", *_memory(report["groups"]["memory"])]
    lines += ["", *_comm(report["groups"]["comm"])]
    return "\n".join(lines)


def _phase(phase: str, p: Mapping[str, Any], all_nodes: bool, top: int) -> list[str]:
    step = p["step_time_us"]
    profiled = p["profiled_step_time_us"]
    lines = [
        f"== {phase} step ({p['tokens']} tokens): {_us(step)} wall (median of {p['step_calls']} calls, "
        f"+-{_us(p['step_spread_us'])})" + (f", {_us(profiled)} under the profiler" if profiled else ""),
        f"   the nodes explain {_pct(p['explained'])} of {p['explained_against']}: {_us(p['node_time_us'])} in nodes, "
        f"{_us(p['unattributed_us'])} between them",
        *_captured(phase, p, p["timer"]),
    ]
    rows = [("stack layer", "time", "share", "what")]
    what = {
        "ops": "contract and plugin kernels (op providers)",
        "graph": f"torch ops between them and {_us(p['stack_layers']['graph'].get('unattributed_us', 0))} unattributed",
        "comm": "collectives",
    }
    for name, entry in p["stack_layers"].items():
        rows.append((name, _us(entry["time_us"]), _pct(entry["share"]), what.get(name, "")))
    lines += _table(rows, right=(1, 2))
    lines.append("")
    rows = [("op", "provider", "stack", "nodes", "time", "share", "per node")]
    for e in p["providers"]:
        rows.append(
            (
                e["op"],
                _who(e),
                e["stack_layer"],
                str(e["nodes"]),
                _us(e["time_us"]),
                _pct(e["share"]),
                _us(e["time_us"] / e["nodes"]),
            )
        )
    lines += _table(rows, right=(3, 4, 5, 6))
    lines.append("")
    rows = [("model layer", "time", "share")]
    for e in p["model_layers"]:
        rows.append(
            (
                "- (embedding, final norm, lm head)" if e["layer"] is None else str(e["layer"]),
                _us(e["time_us"]),
                _pct(e["share"]),
            )
        )
    lines += _table(rows, right=(1, 2))
    nodes = list(p["nodes"]) if all_nodes else sorted(p["nodes"], key=lambda n: -n["time_us"])[:top]
    lines += [
        "",
        "every node, in execution order:" if all_nodes else f"slowest {len(nodes)} nodes (--nodes lists all):",
    ]
    rows = [("node", "op", "provider", "layer", "time", "+-")]
    for n in nodes:
        layer = "-" if n["layer"] is None else str(n["layer"])
        rows.append((n["name"], n["op"], _who(n), layer, _us(n["time_us"]), _us(n["spread_us"])))
    lines += _table(rows, right=(4, 5))
    return lines


def _captured(phase: str, p: Mapping[str, Any], timer: str) -> list[str]:
    """The step as the engine runs it (replayed from a device graph), or why it was not timed (decode only)."""
    captured = p.get("captured_step_time_us")  # absent from profiles written before it was measured
    if captured:
        return [
            f"   captured (as the engine runs it, {p['captured_with']}): {_us(captured)} (median of "
            f"{p['captured_step_calls']} replays, +-{_us(p['captured_step_spread_us'])}); the nodes' {timer} time "
            f"is {_pct(p['explained_captured'])} of it"
        ]
    if p.get("captured_note") and phase == "decode":
        return [f"   captured: not timed ({p['captured_note']})"]
    return []


def _graph(graph: Mapping[str, Any]) -> list[str]:
    compiled = graph.get("compile")
    lines = [
        "== graph: flat graphs run eagerly, node by node" + ("" if compiled else " (--compile also times compilation)")
    ]
    for phase, g in graph["phases"].items():
        counts = g["counts"]
        fired = ", ".join(f"{k} x{v}" for k, v in g["fusions"].items() if v) or "none"
        lines.append(
            f"  {phase}: {counts['contract']} contract, {counts['native']} native"
            + (f", {counts['plugin']} plugin" if counts.get("plugin") else "")
            + f" nodes; fusions fired: {fired}; traced and fused in {g['trace_s']:.2f} s"
        )
    lines.append(
        f"  graph breaks: {graph['graph_breaks']}" + ("" if compiled else " (a flat graph traces whole or fails)")
    )
    if compiled:
        lines.append(
            f"  compiled ({compiled['compiler']}): {compiled['seconds']:.2f} s over {compiled['graphs']} graphs, "
            f"{compiled['pieces']} pieces compiled, {compiled['eager_pieces']} eager (attention), "
            f"{compiled['trivial_pieces']} with nothing to compile"
        )
        for phase, c in compiled["phases"].items():
            lines.append(f"  compiled {phase} step: {_us(c['step_time_us'])} (first call {c['first_call_s']:.2f} s)")
    return lines


def _memory(memory: Mapping[str, Any]) -> list[str]:
    lines = ["== memory"]
    for t in memory["tiers"]:
        lines.append(
            f"  tier {t['tier']} ({t['allocator']}): {_bytes(t['free_bytes'])} free of {_bytes(t['total_bytes'])}; "
            f"through the allocator {_bytes(t['allocated_bytes'])} live in {t['live_buffers']} buffers "
            f"(peak {_bytes(t['peak_bytes'])})"
        )
    kv = memory["kv_cache"]
    lines.append(
        f"  kv cache ({kv['tier']}): {kv['blocks']} blocks of {kv['block_size']} tokens "
        f"({_bytes(kv['block_bytes'])} each, "
        f"{_bytes(kv['bytes'])}): {kv['blocks_used']} used, {kv['blocks_free']} free"
    )
    lines.append(f"  weights: {_bytes(memory['weights_bytes'])}")
    peaks = ", ".join(f"{phase} {_bytes(v)}" for phase, v in memory["step_peak_bytes"].items() if v is not None)
    lines.append(
        f"  step peak above live memory: {peaks or '- (the platform keeps no allocator statistics torch can read)'}"
    )
    return lines


def _comm(comm: Mapping[str, Any]) -> list[str]:
    if not comm["collectives"]:
        return [f"== comm: {comm['note']}"]
    lines = ["== comm"]
    rows = [("phase", "collective", "calls/step", "time/step")]
    for c in comm["collectives"]:
        rows.append((c["phase"], c["collective"], f"{c['calls_per_step']:g}", _us(c["time_us"])))
    return lines + _table(rows, right=(2, 3))


def _value(value: float, unit: str) -> str:
    if unit == "us":
        return _us(value)
    if unit == "bytes":
        return _bytes(value)
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:g} {unit}"


def render_comparison(comparison: Mapping[str, Any], baseline: str = "baseline") -> str:
    """The comparison as text: every regression and improvement, the notes, and the verdict."""
    lines = [
        f"== against {baseline} (a regression: more than {comparison['threshold_pct']:g}% slower, beyond twice the "
        f"noise of either run and {comparison['min_share_pct']:g}% of the step)"
    ]
    rows = [("", "phase", "stack layer", "what", "name", "baseline", "now", "change")]
    for f in [*comparison["regressions"], *comparison["improvements"]]:
        pct = f" ({f['delta_pct']:+.1f}%)" if f["delta_pct"] is not None else " (new)"
        sign = "+" if f["delta"] > 0 else "-"
        rows.append(
            (
                "REGRESSION" if f["verdict"] == "regression" else "improved",
                f["phase"],
                f["stack_layer"],
                f["what"],
                f["name"],
                _value(f["baseline"], f["unit"]),
                _value(f["current"], f["unit"]),
                sign + _value(abs(f["delta"]), f["unit"]) + pct,
            )
        )
    if len(rows) > 1:
        lines += _table(rows, right=(5, 6, 7))
    else:
        lines.append("  no change beyond the threshold and the noise")
    lines += [f"  note: {n}" for n in comparison["notes"]]
    count = len(comparison["regressions"])
    lines.append(f"verdict: {count} regression{'s' if count != 1 else ''}" if count else "verdict: no regression")
    return "\n".join(lines)
