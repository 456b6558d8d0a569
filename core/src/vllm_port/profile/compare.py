"""Compare a profile with a saved baseline: which stack layer, op or provider got slower, and by how much.

Two profiles are comparable only when they profiled the same model shape, built the same way (the
core definition or one importer), dtype, batch shape and platform with the same timer
(:func:`check_comparable` says which field differs otherwise). A time (a phase's step; the same step
replayed from a captured device graph, where both runs captured it; a stack layer, an op over all
its nodes, one provider of an op, a collective) has regressed when it grew by more than all of:

- ``threshold_pct`` percent of the baseline's time;
- the noise: twice the larger spread of the two runs (half the interquartile range over repeats);
- the floor: ``min_share_pct`` percent of the baseline's step time, or of its captured step for
  that one (changes too small to matter).

Structure regresses too: a fusion that fired fewer times, more kernel nodes in a graph, and more
bytes (weights, KV cache, a step's peak) beyond the threshold. A different provider bound for an op
is a note, not a regression by itself: its time is what counts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from .schema import DEFAULT_MIN_SHARE_PCT, DEFAULT_THRESHOLD_PCT, FORMAT, SCHEMA_VERSION, STACK_LAYERS, ProfileError

__all__ = ["check_comparable", "compare", "load_baseline"]

#: Fields two comparable profiles share (the device name only warns: CI runners differ in processor).
_IDENTITY = (
    ("importer", "--importer"),
    ("model", "the model's shape"),
    ("dtype", "--dtype"),
    ("shape", "--batch/--context"),
    ("platform", "--device"),
)


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read a baseline written by ``vllm-port profile --json``.

    :raises ProfileError: when the file is missing, is not JSON or is not a profile of this format.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ProfileError(f"baseline {path}: cannot read it ({exc.strerror}); give a file written by --json") from exc
    try:
        report = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(
            f"baseline {path}: not JSON ({exc.msg} at line {exc.lineno}); give a file written by --json"
        ) from exc
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise ProfileError(f'baseline {path}: not a vllm-port profile (no "format": "{FORMAT}"); write one with --json')
    if report.get("version") != SCHEMA_VERSION:
        raise ProfileError(
            f"baseline {path}: profile format version {report.get('version')!r}, this vllm-port reads "
            f"version {SCHEMA_VERSION}; record the baseline again with this version"
        )
    return report


def check_comparable(current: Mapping[str, Any], baseline: Mapping[str, Any], where: str = "baseline") -> list[str]:
    """Refuse a baseline of another model or importer, dtype, batch shape, platform or timer; return notes on
    lesser differences.

    :raises ProfileError: naming each field that differs, both values, and how to fix it.
    """
    problems = []
    for field, option in _IDENTITY:
        if current.get(field) != baseline.get(field):
            was, now = (
                _importer(v) if field == "importer" else _short(v) for v in (baseline.get(field), current.get(field))
            )
            problems.append(f"{field} {was} in the baseline, {now} now ({option})")
    if current.get("timer") != baseline.get("timer") and "timer" in current:
        problems.append(f"timer {baseline.get('timer')!r} in the baseline, {current.get('timer')!r} now")
    if not set(current.get("phases", {})) & set(baseline.get("phases", {})):
        problems.append(
            f"phases {sorted(baseline.get('phases', {}))} in the baseline, "
            f"{sorted(current.get('phases', {}))} now (--phase)"
        )
    if problems:
        raise ProfileError(
            f"{where} is not comparable with this profile: "
            + "; ".join(problems)
            + ". Profile with the baseline's options, or record a new baseline with --json"
        )
    notes = []
    if current.get("device") != baseline.get("device"):
        notes.append(
            f"device {baseline.get('device')!r} in the baseline, {current.get('device')!r} now: "
            "times may differ for that"
        )
    return notes


def _importer(value: Any) -> str:
    """Who built the profiled model; profiles from before importers were profiled have no field: the core model."""
    return "none (the core model definition)" if value is None else f"{value!r} (an imported model)"


def _short(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}={v}" for k, v in value.items() if k != "fingerprint") + "}"
    return repr(value)


def compare(
    current: Mapping[str, Any],
    baseline: Mapping[str, Any],
    threshold_pct: float = DEFAULT_THRESHOLD_PCT,
    min_share_pct: float = DEFAULT_MIN_SHARE_PCT,
) -> dict[str, Any]:
    """What regressed and improved from ``baseline`` to ``current`` (see the module docstring).

    :return: ``{"regressions": [...], "improvements": [...], "notes": [...], "ok": bool, ...}``;
        each finding names its ``phase``, ``stack_layer``, ``what`` (``step``, ``stack layer``, ``op``,
        ``provider``, ``collective``, ``fusion``, ``nodes``, ``memory``, ``compile``) and ``name``, the
        ``baseline`` and ``current`` values, ``delta``, ``delta_pct`` and ``unit``.
    :raises ProfileError: when the two are not comparable (:func:`check_comparable`).
    """
    if threshold_pct < 0 or min_share_pct < 0:
        raise ProfileError(f"profile: --threshold {threshold_pct} and --min-share {min_share_pct} must be >= 0")
    notes = check_comparable(current, baseline)
    rule = _Rule(threshold_pct / 100)
    findings: list[dict[str, Any]] = []
    for phase in [p for p in current["phases"] if p in baseline["phases"]]:
        cur, base = current["phases"][phase], baseline["phases"][phase]
        floor = min_share_pct / 100 * base["step_time_us"]
        step = {"time_us": cur["step_time_us"], "spread_us": cur["step_spread_us"]}
        base_step = {"time_us": base["step_time_us"], "spread_us": base["step_spread_us"]}
        findings += rule.time(phase, "all", "step", "step", base_step, step, floor)
        findings += _captured_step(rule, phase, base, cur, min_share_pct)
        for layer in STACK_LAYERS:
            findings += rule.time(
                phase,
                layer,
                "stack layer",
                layer,
                base["stack_layers"].get(layer),
                cur["stack_layers"].get(layer),
                floor,
            )
        findings += _entities(rule, phase, "op", base["ops"], cur["ops"], lambda e: e["op"], floor)
        findings += _entities(
            rule, phase, "provider", base["providers"], cur["providers"], lambda e: _provider_name(e), floor
        )
        notes += _provider_changes(phase, base["providers"], cur["providers"])
    findings += _graph(rule, current["groups"]["graph"], baseline["groups"]["graph"])
    findings += _memory(rule, current["groups"]["memory"], baseline["groups"]["memory"])
    findings += _comm(rule, current["groups"]["comm"], baseline["groups"]["comm"], current, baseline, min_share_pct)
    regressions = sorted((f for f in findings if f["verdict"] == "regression"), key=_order)
    improvements = sorted((f for f in findings if f["verdict"] == "improvement"), key=_order)
    return {
        "threshold_pct": threshold_pct,
        "min_share_pct": min_share_pct,
        "regressions": regressions,
        "improvements": improvements,
        "notes": notes,
        "ok": not regressions,
    }


def _captured_step(
    rule: _Rule, phase: str, base: Mapping[str, Any], cur: Mapping[str, Any], min_share_pct: float
) -> list[dict[str, Any]]:
    """The step replayed from a device graph, where both runs captured it (baselines from before it have no field)."""
    was, now = base.get("captured_step_time_us"), cur.get("captured_step_time_us")
    if not was or not now:
        return []
    before = {"time_us": was, "spread_us": base.get("captured_step_spread_us") or 0.0}
    after = {"time_us": now, "spread_us": cur.get("captured_step_spread_us") or 0.0}
    return rule.time(phase, "all", "step", "captured step", before, after, min_share_pct / 100 * was)


_WHAT_ORDER = ("step", "stack layer", "op", "provider", "collective", "fusion", "nodes", "compile", "memory")


def _order(finding: dict[str, Any]) -> tuple:
    return (finding["phase"], _WHAT_ORDER.index(finding["what"]), -abs(finding["delta"]))


def _provider_name(entry: Mapping[str, Any]) -> str:
    who = f"{entry['plugin']}:{entry['provider']}" if entry["plugin"] else entry["provider"]
    return f"{entry['op']} {who}"


class _Rule:
    """Decides, per value, whether a change is a regression, an improvement, or within noise and threshold."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def time(
        self,
        phase: str,
        stack_layer: str,
        what: str,
        name: str,
        base: Mapping[str, Any] | None,
        cur: Mapping[str, Any] | None,
        floor_us: float,
        unit: str = "us",
    ) -> list[dict[str, Any]]:
        b = base["time_us"] if base else 0.0
        c = cur["time_us"] if cur else 0.0
        noise = 2 * max(base["spread_us"] if base else 0.0, cur["spread_us"] if cur else 0.0)
        limit = max(self.threshold * b, noise, floor_us)
        return self.judge(phase, stack_layer, what, name, b, c, limit, unit, noise=noise)

    def amount(
        self, phase: str, stack_layer: str, what: str, name: str, base: float, cur: float, unit: str, floor: float = 0.0
    ) -> list[dict[str, Any]]:
        return self.judge(phase, stack_layer, what, name, base, cur, max(self.threshold * base, floor), unit)

    @staticmethod
    def judge(
        phase: str,
        stack_layer: str,
        what: str,
        name: str,
        b: float,
        c: float,
        limit: float,
        unit: str,
        fewer_is_worse: bool = False,
        **extra: Any,
    ) -> list[dict[str, Any]]:
        delta = c - b
        if abs(delta) <= limit or delta == 0:
            return []
        worse = delta < 0 if fewer_is_worse else delta > 0
        return [
            {
                "verdict": "regression" if worse else "improvement",
                "phase": phase,
                "stack_layer": stack_layer,
                "what": what,
                "name": name,
                "baseline": b,
                "current": c,
                "delta": delta,
                "delta_pct": 100 * delta / b if b else None,
                "unit": unit,
                **extra,
            }
        ]


def _entities(
    rule: _Rule,
    phase: str,
    what: str,
    base: Iterable[Mapping[str, Any]],
    cur: Iterable[Mapping[str, Any]],
    key: Callable[[Mapping[str, Any]], str],
    floor: float,
) -> list[dict[str, Any]]:
    before = {key(e): e for e in base}
    after = {key(e): e for e in cur}
    found = []
    for name in [*after, *(k for k in before if k not in after)]:
        entry = after.get(name) or before[name]
        found += rule.time(phase, entry["stack_layer"], what, name, before.get(name), after.get(name), floor)
    return found


def _provider_changes(phase: str, base: Iterable[Mapping[str, Any]], cur: Iterable[Mapping[str, Any]]) -> list[str]:
    def by_op(entries: Iterable[Mapping[str, Any]]) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for e in entries:
            if e["stack_layer"] == "ops":
                found.setdefault(e["op"], set()).add(_provider_name(e).split(" ", 1)[1])
        return found

    before, after = by_op(base), by_op(cur)
    return [
        f"{phase}: op {op} is served by {', '.join(sorted(after[op]))} (baseline: {', '.join(sorted(before[op]))})"
        for op in sorted(set(before) & set(after))
        if before[op] != after[op]
    ]


def _graph(rule: _Rule, cur: Mapping[str, Any], base: Mapping[str, Any]) -> list[dict[str, Any]]:
    found = []
    for phase in [p for p in cur["phases"] if p in base["phases"]]:
        c, b = cur["phases"][phase], base["phases"][phase]
        for name in sorted(set(c["fusions"]) | set(b["fusions"])):
            fired, was = c["fusions"].get(name, 0), b["fusions"].get(name, 0)
            # a fusion that fires fewer times is a regression whatever the times say
            found += rule.judge(phase, "graph", "fusion", name, was, fired, 0, "fired", fewer_is_worse=True)
        kernels = sum(v for k, v in c["counts"].items() if k != "shape")
        was_kernels = sum(v for k, v in b["counts"].items() if k != "shape")
        found += rule.judge(phase, "graph", "nodes", "kernel nodes", was_kernels, kernels, 0, "nodes")
    if cur.get("compile") and base.get("compile"):
        found += rule.amount(
            "all", "graph", "compile", "compile time", base["compile"]["seconds"], cur["compile"]["seconds"], "s", 1.0
        )
        found += rule.judge(
            "all",
            "graph",
            "compile",
            "graph breaks",
            base["compile"]["graph_breaks"],
            cur["compile"]["graph_breaks"],
            0,
            "breaks",
        )
    return found


def _memory(rule: _Rule, cur: Mapping[str, Any], base: Mapping[str, Any]) -> list[dict[str, Any]]:
    found = rule.amount("all", "memory", "memory", "weights", base["weights_bytes"], cur["weights_bytes"], "bytes")
    found += rule.amount(
        "all", "memory", "memory", "kv cache", base["kv_cache"]["bytes"], cur["kv_cache"]["bytes"], "bytes"
    )
    for phase, peak in cur["step_peak_bytes"].items():
        was = base["step_peak_bytes"].get(phase)
        if peak is not None and was is not None:
            found += rule.amount(phase, "memory", "memory", "step peak", was, peak, "bytes")
    return found


def _comm(
    rule: _Rule,
    cur: Mapping[str, Any],
    base: Mapping[str, Any],
    current: Mapping[str, Any],
    baseline: Mapping[str, Any],
    min_share_pct: float,
) -> list[dict[str, Any]]:
    found = []
    for phase in [p for p in current["phases"] if p in baseline["phases"]]:
        floor = min_share_pct / 100 * baseline["phases"][phase]["step_time_us"]

        def mine(entries: Iterable[Mapping[str, Any]], phase: str = phase) -> list[Mapping[str, Any]]:
            return [{**e, "stack_layer": "comm"} for e in entries if e["phase"] == phase]

        found += _entities(
            rule,
            phase,
            "collective",
            mine(base["collectives"]),
            mine(cur["collectives"]),
            lambda e: e["collective"],
            floor,
        )
    return found
