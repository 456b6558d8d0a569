"""``vllm-port doctor``: what is installed, what was selected and why, which kernel serves each op, and a smoke test of each.

Every candidate provider is smoke-checked against the float64 reference before it is bound
(``runtime.bind(dtype, verify=True)``): one that raises or returns a wrong shape, dtype, device or
values is marked failed with the reason, and the report says which provider serves instead. A bound
provider far slower than the reference gets a warning. Strict mode's objections are listed too. The selected
platform is probed again once its kernels are bound, so the report names what binding built and
loaded (the CPU plugin's native library).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import torch

from .api import API_VERSION
from .discovery import Discovery, PluginRecord, discover, probe_again
from .errors import SelectionError, VllmPortError
from .faults import STRICT_ENV, strict_mode
from .host_threads import check_threads
from .ops import REFERENCE
from .ops.debug import smoke_samples
from .runtime import Runtime, select

__all__ = ["SMOKE_DTYPES", "diagnose", "render"]

SMOKE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The dtype whose binding ``doctor`` reports as each op's ``provider``.
REPORT_DTYPE = torch.bfloat16
#: A bound provider this many times slower than the reference on a smoke sample, and slower than
#: SLOW_MIN_S, gets a warning: kernels exist to be faster than the plain-torch reference; a
#: microsecond-sized sample is left alone, where launch costs dominate.
SLOW_FACTOR = 20.0
SLOW_MIN_S = 0.02


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


def _timed(fn: Any, args: tuple[Any, ...], mutated: list[int], device: torch.device, repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` warm calls of ``fn`` (in-place arguments copied each time,
    so the sample stays as it was)."""
    best = float("inf")
    for attempt in range(repeats + 1):  # the first call warms up: it may compile
        fresh = tuple(a.clone() if i in mutated else a for i, a in enumerate(args))
        if device.type != "cpu":
            torch.accelerator.synchronize()
        start = time.perf_counter()
        fn(*fresh)
        if device.type != "cpu":
            torch.accelerator.synchronize()
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def slowness(runtime: Runtime, op: Any, chosen: Any, dtype: torch.dtype) -> str | None:
    """A warning when ``chosen`` is far slower than the reference on the op's first smoke sample, else ``None``."""
    if chosen.name == REFERENCE:
        return None
    sample = smoke_samples(op, dtype, runtime.device)[0]
    mutated = [i for i, n in enumerate(op.signature.parameters) if n in op.mutates]
    try:
        took = _timed(chosen.fn, sample.args, mutated, runtime.device)
        reference = _timed(op.reference, sample.args, mutated, runtime.device)
    except Exception:  # the smoke check reports failures; timing only warns
        return None
    if took < SLOW_MIN_S or took < SLOW_FACTOR * reference:
        return None
    return (
        f"{chosen.name} ({chosen.plugin}) {dtype}: {took * 1e3:.1f} ms on sample {sample.label!r}, where the reference "
        f"takes {reference * 1e3:.2f} ms ({took / max(reference, 1e-9):.0f}x); if that is not its first-call cost, "
        f"VLLM_PORT_OP_PROVIDERS={op.name}=reference runs without it"
    )


def smoke(runtime: Runtime, dtype: torch.dtype) -> tuple[Any, dict[str, str], dict[str, str]]:
    """Bind ``dtype`` smoke-checking every candidate against the float64 reference on each op's small samples.

    Returns the bound ops (those that failed are in ``skipped``), op -> ``PASS`` or ``FAIL: <provider>
    (<plugin>) <dtype>: <why>; serves instead: <provider>``, and op -> a warning for a provider far
    slower than the reference.
    """
    kernels = runtime.bind(dtype, verify=True, check=False, strict=False)
    verdicts: dict[str, str] = {}
    slow: dict[str, str] = {}
    for name, op in runtime.registry.ops.items():
        chosen = kernels.providers[name]
        failed = kernels.skipped.get(name, [])
        verdicts[name] = "PASS"
        if failed:
            bad, why = failed[0]
            verdicts[name] = f"FAIL: {bad.name} ({bad.plugin}) {dtype}: {why}; serves instead: {chosen.name}"
        warning = slowness(runtime, op, chosen, dtype)
        if warning:
            slow[name] = warning
    return kernels, verdicts, slow


def _memory(runtime: Runtime) -> dict[str, Any]:
    try:
        allocator = runtime.allocator()
        free, total = allocator.mem_info()
    except Exception as exc:  # doctor reports; it never crashes
        return {"allocator": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"allocator": allocator.name, "free": free, "total": total, "error": None}


def _comm(runtime: Runtime) -> dict[str, Any]:
    try:
        return {"served_by": runtime.communicator().served_by, "error": None}
    except Exception as exc:
        return {"served_by": {}, "error": f"{type(exc).__name__}: {exc}"}


def _platform_facts(description: Any) -> dict[str, Any]:
    """What an engine takes from the selected platform's description."""
    return {
        "graph_capture": description.graph_capture,
        "compile_backend": description.compile_backend,
        "memory_tiers": list(description.memory_tiers),
        "kv_block_size": description.kv_block_size,
        "kv_head_major": description.kv_head_major,
        "dist_backend": description.dist_backend,
    }


def diagnose(plugins: str | None = None, device: str | None = None, strict: bool | None = None) -> dict[str, Any]:
    """Everything ``doctor`` reports, as one JSON-ready object.

    Keys: ``api_version``, ``selected``, ``selection_reason``, ``platform`` (the selected platform's
    static facts: graph capture, compile backend, memory tiers, KV block size), ``error``, ``plugins``, ``excluded``,
    ``ops`` (op -> bound ``provider``, ``by_dtype``, ``candidates``, ``failed`` providers with the
    reason and what serves instead, ``slow`` warnings), ``smoke`` (op -> PASS/FAIL), ``memory``,
    ``comm``, ``fallbacks`` (what the layer replaced on its own), ``strict`` and ``strict_problems``
    (what strict mode refuses), ``threads`` (torch threads against the usable cores and the load:
    :func:`vllm_port.host_threads.check_threads`; its ``advice`` says what to set when they do not
    fit), ``ok``.

    :param strict: judge as strict mode does (``VLLM_PORT_STRICT`` when ``None``): any problem it refuses
        makes the report not ok. Doctor itself never stops at one: it reports them all.
    """
    report: dict[str, Any] = {"api_version": API_VERSION, "selected": None, "selection_reason": None, "error": None}
    empty = {"plugins": [], "excluded": [], "ops": {}, "smoke": {}, "memory": {}, "comm": {}, "fallbacks": []}
    try:
        strict = strict_mode(strict)
        found: Discovery = discover(plugins, strict=False)
    except SelectionError as exc:
        return {**report, **empty, "error": str(exc), "strict": bool(strict), "strict_problems": [], "ok": False}
    report["plugins"] = [_plugin_json(r) for r in found.plugins]
    report["excluded"] = found.excluded
    runtime: Runtime | None = None
    try:
        selected, reason = select(found, device)
        runtime = Runtime(found, selected, reason)
        report["selected"], report["selection_reason"] = selected.description.name, reason  # type: ignore[union-attr]
        report["platform"] = _platform_facts(selected.description)
    except SelectionError as exc:
        report["error"] = str(exc)
    report["ops"] = {}
    for name in found.registry.ops:
        candidates = [
            {"provider": p.name, "plugin": p.plugin, "platform": p.platform, "priority": p.priority}
            for p in found.registry.candidates(name)
        ]
        report["ops"][name] = {"provider": None, "by_dtype": {}, "candidates": candidates, "failed": [], "slow": []}
    report["smoke"], report["fallbacks"], report["memory"], report["comm"] = {}, [], {}, {}
    if runtime is not None:
        try:
            for dtype in SMOKE_DTYPES:
                kernels, verdicts, slow = smoke(runtime, dtype)
                report["fallbacks"] += kernels.fallbacks
                for name, chosen in kernels.providers.items():
                    info = report["ops"][name]
                    info["by_dtype"][str(dtype).removeprefix("torch.")] = chosen.name
                    if dtype == REPORT_DTYPE:
                        info["provider"] = chosen.name
                    info["failed"] += [
                        {"provider": p.name, "plugin": p.plugin, "dtype": str(dtype).removeprefix("torch."),
                         "reason": why, "instead": chosen.name}
                        for p, why in kernels.skipped.get(name, [])
                    ]  # fmt: skip
                    if name in slow:
                        info["slow"].append(slow[name])
                for name, verdict in verdicts.items():
                    if report["smoke"].get(name, "PASS") == "PASS":
                        report["smoke"][name] = verdict
        except VllmPortError as exc:
            report["error"] = str(exc)
        report["memory"], report["comm"] = _memory(runtime), _comm(runtime)
        report["fallbacks"] += runtime.fallbacks
        probe_again(found, selected)  # what binding built and loaded (a kernel library) shows only now
        report["plugins"] = [_plugin_json(r) for r in found.plugins]
    thread_check = check_threads()
    report["threads"] = {**dataclasses.asdict(thread_check), "oversubscribed": thread_check.oversubscribed}
    report["strict"] = strict
    report["strict_problems"] = found.problems + list(dict.fromkeys(report["fallbacks"]))
    report["ok"] = (
        report["error"] is None
        and bool(report["smoke"])
        and all(v == "PASS" for v in report["smoke"].values())
        and not (strict and report["strict_problems"])
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
        facts = report.get("platform") or {}
        if facts:
            lines.append(
                f"  graph capture: {'yes' if facts['graph_capture'] else 'no'}; compile backend: "
                f"{facts['compile_backend']}; memory tiers: {', '.join(facts['memory_tiers'])}; "
                f"KV block size: {facts['kv_block_size']} tokens"
                f"{', head-major' if facts.get('kv_head_major') else ''}; comm: {facts['dist_backend']}"
            )
    if report["error"]:
        lines.append(f"Error: {report['error']}")
    if report["ops"]:
        lines += [
            "",
            f"Ops (bound provider for {str(REPORT_DTYPE).removeprefix('torch.')}; smoke test over float32/bfloat16/float16):",
        ]
        width = max(20, *(len(name) for name in report["ops"]))  # the FP8 cache ops' names pass 20 characters
        for name, info in report["ops"].items():
            others = ", ".join(
                c["provider"]
                if c["provider"] == REFERENCE
                else f"{c['provider']} ({c['plugin']}, priority {c['priority']})"
                for c in info["candidates"]
            )
            verdict = report["smoke"].get(name, "not run")
            lines.append(f"  {name:<{width}} {info['provider']!s:<25} {verdict}")
            lines.append(f"  {'':<{width}} candidates: {others}")
            lines += [
                f"  {'':<{width}} ! failed: {f['provider']} ({f['plugin']}) {f['dtype']}: {f['reason']} -> {f['instead']} serves instead"
                for f in info.get("failed", [])
            ]
            lines += [f"  {'':<{width}} ! slow: {warning}" for warning in info.get("slow", [])]
    memory, comm = report.get("memory") or {}, report.get("comm") or {}
    if memory:
        lines.append("")
        if memory.get("error"):
            lines.append(f"Memory: error: {memory['error']}")
        else:
            lines.append(
                f"Memory: allocator {memory['allocator']!r}: {memory['free']:,} of {memory['total']:,} bytes free"
            )
    if comm:
        served = ", ".join(f"{part}: {name}" for part, name in comm.get("served_by", {}).items())
        lines.append(f"Comm: error: {comm['error']}" if comm.get("error") else f"Comm: {served}")
    threads = report.get("threads")
    if threads:
        load = "no load average" if threads["load_average"] is None else f"load average {threads['load_average']:.2f}"
        lines.append(f"Host threads: {threads['torch_threads']} torch threads, {threads['cores']} usable cores, {load}")
        if threads["advice"]:
            lines.append(f"  ! oversubscribed: {threads['advice']}")
    if report.get("fallbacks"):
        lines += ["", "Fallbacks (what vllm-port replaced on its own; strict mode refuses each):"]
        lines += [f"  - {what}" for what in dict.fromkeys(report["fallbacks"])]
    if report.get("strict"):
        problems = report.get("strict_problems") or []
        lines += [
            "",
            f"Strict mode ({STRICT_ENV}=1): "
            + (f"{len(problems)} problem(s) refused" if problems else "nothing to refuse"),
        ]
        lines += [f"  - {p}" for p in problems]
    lines += ["", "OK" if report["ok"] else "NOT OK"]
    return "\n".join(lines)


def dumps(report: dict[str, Any]) -> str:
    """The report as indented JSON."""
    return json.dumps(report, indent=2, default=str)
