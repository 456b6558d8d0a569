"""``vllm-port doctor``: what is installed, what was selected and why, which kernel serves each op, and a smoke test of each."""

from __future__ import annotations

import json
from typing import Any

import torch

from .api import API_VERSION
from .discovery import Discovery, PluginRecord, discover
from .errors import SelectionError
from .ops import REFERENCE
from .runtime import Runtime, select

__all__ = ["SMOKE_DTYPES", "diagnose", "render"]

SMOKE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The dtype whose binding ``doctor`` reports as each op's ``provider``.
REPORT_DTYPE = torch.bfloat16


def _plugin_json(record: PluginRecord) -> dict[str, Any]:
    desc, probe = record.description, record.probe
    return {
        "name": record.name,
        "distribution": record.distribution,
        "version": record.version,
        "api_range": record.api_range,
        "available": record.available,
        "reason": record.reason,
        "device_type": desc.device_type if desc else None,
        "device_count": probe.device_count if probe else 0,
        "priority": desc.priority if desc else None,
        "devices": [vars(d) for d in probe.devices] if probe else [],
        "capabilities": dict(probe.capabilities) if probe else {},
        "providers": [p.name for p in record.providers],
        "rejected_providers": record.rejected,
        "error": record.error,
    }


def smoke(runtime: Runtime, dtype: torch.dtype) -> dict[str, str]:
    """Run every op's bound provider for ``dtype`` on its small samples against the float64 reference."""
    kernels = runtime.bind(dtype)
    gen = torch.Generator().manual_seed(0)
    results: dict[str, str] = {}
    for name, op in runtime.registry.ops.items():
        chosen = kernels.providers[name]
        try:
            for sample in op.samples(dtype, runtime.device, gen)[:2]:
                problem = op.check(chosen.fn, sample.args, dtype)
                if problem:
                    raise AssertionError(f"{sample.label}: {problem}")
            results[name] = "PASS"
        except Exception as exc:  # a smoke test reports, it never crashes doctor
            results[name] = f"FAIL: {chosen.name} ({chosen.plugin}) {dtype}: {type(exc).__name__}: {exc}"
    return results


def diagnose(plugins: str | None = None, device: str | None = None) -> dict[str, Any]:
    """Everything ``doctor`` reports, as one JSON-ready object.

    Keys: ``api_version``, ``selected``, ``selection_reason``, ``error``, ``plugins``, ``excluded``,
    ``ops`` (op -> bound ``provider``, ``by_dtype`` and ``candidates``), ``smoke`` (op -> PASS/FAIL), ``ok``.
    """
    report: dict[str, Any] = {"api_version": API_VERSION, "selected": None, "selection_reason": None, "error": None}
    try:
        found: Discovery = discover(plugins)
    except SelectionError as exc:
        return {**report, "error": str(exc), "plugins": [], "excluded": [], "ops": {}, "smoke": {}, "ok": False}
    report["plugins"] = [_plugin_json(r) for r in found.plugins]
    report["excluded"] = found.excluded
    runtime: Runtime | None = None
    try:
        selected, reason = select(found, device)
        runtime = Runtime(found, selected, reason)
        report["selected"], report["selection_reason"] = selected.description.name, reason  # type: ignore[union-attr]
    except SelectionError as exc:
        report["error"] = str(exc)
    report["ops"] = {}
    for name in found.registry.ops:
        candidates = [
            {"provider": p.name, "plugin": p.plugin, "platform": p.platform, "priority": p.priority}
            for p in found.registry.candidates(name)
        ]
        report["ops"][name] = {"provider": None, "by_dtype": {}, "candidates": candidates}
    report["smoke"] = {}
    if runtime is not None:
        try:
            for dtype in SMOKE_DTYPES:
                for name, chosen in runtime.bind(dtype).providers.items():
                    report["ops"][name]["by_dtype"][str(dtype).removeprefix("torch.")] = chosen.name
                    if dtype == REPORT_DTYPE:
                        report["ops"][name]["provider"] = chosen.name
                for name, verdict in smoke(runtime, dtype).items():
                    if report["smoke"].get(name, "PASS") == "PASS":
                        report["smoke"][name] = verdict
        except SelectionError as exc:
            report["error"] = str(exc)
    report["ok"] = (
        report["error"] is None and bool(report["smoke"]) and all(v == "PASS" for v in report["smoke"].values())
    )
    return report


def render(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [
        f"vllm-port doctor - contract API {report['api_version']}",
        "",
        "Plugins:" if report["plugins"] else "Plugins: none loaded",
    ]
    header = ("plugin", "version", "api", "available", "priority", "device", "count", "reason")
    rows = [header] * bool(report["plugins"]) + [
        (p["name"], p["version"], p["api_range"] or "-", "yes" if p["available"] else "no", str(p["priority"]),
         p["device_type"] or "-", str(p["device_count"]), p["reason"])
        for p in report["plugins"]
    ]  # fmt: skip
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(len(header) - 1)]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]
    for p in report["plugins"]:
        lines += [f"  ! {p['name']}: provider refused: {msg}" for msg in p["rejected_providers"]]
    if report.get("excluded"):
        lines.append(f"  excluded by the plugin filter: {', '.join(report['excluded'])}")
    lines.append("")
    if report["selected"]:
        lines.append(f"Selected platform: {report['selected']} ({report['selection_reason']})")
    if report["error"]:
        lines.append(f"Error: {report['error']}")
    if report["ops"]:
        lines += [
            "",
            f"Ops (bound provider for {str(REPORT_DTYPE).removeprefix('torch.')}; smoke test over float32/bfloat16/float16):",
        ]
        for name, info in report["ops"].items():
            others = ", ".join(
                c["provider"]
                if c["provider"] == REFERENCE
                else f"{c['provider']} ({c['plugin']}, priority {c['priority']})"
                for c in info["candidates"]
            )
            verdict = report["smoke"].get(name, "not run")
            lines.append(f"  {name:<20} {info['provider']!s:<22} {verdict}")
            lines.append(f"  {'':<20} candidates: {others}")
    lines += ["", "OK" if report["ok"] else "NOT OK"]
    return "\n".join(lines)


def dumps(report: dict[str, Any]) -> str:
    """The report as indented JSON."""
    return json.dumps(report, indent=2, default=str)
