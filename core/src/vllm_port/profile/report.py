"""The report's groups: a phase's node times summed by stack layer, op, provider and model layer, and the
memory (tiers, KV cache, weights, each step's peak) and graph (graphs, fusions, the compiled steps) groups.

Each group's time is also given as its share of what the node times are held against: the step's
wall time for device times, the profiled steps for host times (:func:`_phase_report` says why).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from ..flat import FlatModel
from ..graph_capture import GraphCapture
from ..memory import KVCache
from .schema import STACK_LAYERS
from .steps import _Step, _synchronize, collective_name
from .timing import _captured_step_time, _profiled, _spread, _wall_time

# ------------------------------------------------------------------------------------------------
# Grouping
# ------------------------------------------------------------------------------------------------


def _group(nodes: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[Any, dict[str, float]]:
    """Per key: the summed median times of its nodes, their summed spreads and the node count.

    Sums of per-node medians, not medians of per-step sums: on a shared host each step has its
    outlier somewhere, which a per-step sum would carry into every group.
    """
    found: dict[Any, dict[str, float]] = {}
    for node in nodes:
        entry = found.setdefault(key(node), {"time_us": 0.0, "spread_us": 0.0, "nodes": 0})
        entry["time_us"] += node["time_us"]
        entry["spread_us"] += node["spread_us"]
        entry["nodes"] += 1
    return found


def _share(entry: dict[str, Any], step_us: float) -> dict[str, Any]:
    entry["share"] = entry["time_us"] / step_us if step_us > 0 else 0.0
    return entry


def _phase_report(
    step: _Step,
    repeats: int,
    activity: ProfilerActivity | None,
    device: torch.device,
    min_run_time: float,
    capture: tuple[GraphCapture | None, str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    run_ranged = step.run_ranged
    for _ in range(2):  # warm both paths: first calls allocate and pick kernels
        step.run()
        run_ranged()
    _synchronize(device)
    step_us, step_spread, calls = _wall_time(step.run, min_run_time)
    peak = _step_peak_bytes(step.run, device)
    host, attribution, profiled_steps, gaps, comm = _profiled(step, repeats, activity, device)
    # after the profiler's session: none of its work is recorded into the graph or timed with the replays
    captured = _captured_step_time(step, *capture, min_run_time)
    dev = attribution.per_label
    use_device = activity is not None and any(v > 0 for times in dev.values() for v in times)
    nodes = []
    for node in step.nodes:
        label = node["name"]
        h, d = host.get(label, []), dev.get(label, [])
        times = d if use_device else h
        nodes.append(
            {
                **node,
                "time_us": statistics.median(times) if times else 0.0,
                "spread_us": _spread(times),
                "host_time_us": statistics.median(h) if h else 0.0,
                "device_time_us": (statistics.median(d) if d else 0.0) if use_device else None,
            }
        )
    node_us = sum(n["time_us"] for n in nodes)
    # What the node times are held against. Device time is not inflated by the profiler's host work:
    # the plain step's wall time. Host time is (the profiler records each op inside each range): the
    # profiled steps, as the nodes plus the median time between them within one step, which a
    # preemption of the process (a whole scheduler slice on a shared host) spoils far less often
    # than a whole step's median.
    if use_device or not gaps:
        whole_us, whole_spread, against = step_us, step_spread, "the step's wall time"
        unattributed = max(0.0, step_us - node_us)
    else:
        unattributed, whole_spread = statistics.median(gaps), _spread(gaps)
        whole_us, against = (
            node_us + unattributed,
            "the profiled steps (the nodes and the median time between them in a step; "
            "the profiler's host work inflates both)",
        )
    # the node times held against the step as the engine runs it too (replayed from a device graph)
    captured_us = captured["captured_step_time_us"]
    stacks = _group(nodes, lambda n: n["stack_layer"])
    for name in STACK_LAYERS:
        stacks.setdefault(name, {"time_us": 0.0, "spread_us": 0.0, "nodes": 0})
    # the graph layer also owns what no node explains: the executor's work between nodes (launches, dispatch)
    stacks["graph"]["time_us"] += unattributed
    stacks["graph"]["spread_us"] += whole_spread
    stacks["graph"]["unattributed_us"] = unattributed
    ops = _group(nodes, lambda n: n["op"])
    providers = _group(nodes, lambda n: (n["op"], n["plugin"], n["provider"], n["stack_layer"]))
    layers = _group(nodes, lambda n: n["layer"])
    report = {
        "step_time_us": step_us,
        "step_spread_us": step_spread,
        "step_calls": calls,
        "profiled_step_time_us": statistics.median(profiled_steps) if profiled_steps else None,
        "node_time_us": node_us,
        "explained": node_us / whole_us if whole_us > 0 else 0.0,
        "explained_against": against,
        "unattributed_us": unattributed,
        **captured,
        "explained_captured": node_us / captured_us if captured_us else None,
        "timer": "device" if use_device else "host",
        # device time inside some node's range: far below 1 means the host and device clocks disagree
        "device_work_in_nodes": attribution.inside_share if use_device else None,
        "step_peak_bytes": peak,
        "tokens": int(step.input_ids.shape[0]),
        "nodes": nodes,
        "stack_layers": {k: _share(v, whole_us) for k, v in stacks.items()},
        "ops": [
            _share({"op": op, **v, "stack_layer": _stack_of(nodes, op)}, whole_us)
            for op, v in sorted(ops.items(), key=lambda kv: -kv[1]["time_us"])
        ],
        "providers": [
            _share({"op": op, "plugin": plugin, "provider": provider, "stack_layer": stack, **v}, whole_us)
            for (op, plugin, provider, stack), v in sorted(providers.items(), key=lambda kv: -kv[1]["time_us"])
        ],
        "model_layers": [
            _share({"layer": layer, **v}, whole_us)
            for layer, v in sorted(layers.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0))
        ],
    }
    return report, _collectives(comm, repeats)


def _stack_of(nodes: Iterable[dict[str, Any]], op: str) -> str:
    return next(n["stack_layer"] for n in nodes if n["op"] == op)


def _collectives(events: Sequence[dict[str, Any]], repeats: int) -> list[dict[str, Any]]:
    """Collective calls seen in the profiled steps: per collective, calls and time per step."""
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        name = collective_name(event["name"]) or event["name"]
        entry = found.setdefault(name, {"collective": name, "calls": 0, "host_us": 0.0, "device_us": 0.0})
        entry["calls"] += 1
        entry["host_us"] += event["host_us"]
        entry["device_us"] += event["device_us"]
    per_step = max(repeats, 1)
    return [
        {
            "collective": e["collective"],
            "calls_per_step": e["calls"] / per_step,
            "time_us": (e["device_us"] or e["host_us"]) / per_step,
            "spread_us": 0.0,
        }
        for e in found.values()
    ]


# ------------------------------------------------------------------------------------------------
# Memory and the graph layer
# ------------------------------------------------------------------------------------------------


def _step_peak_bytes(run: Callable[[], Any], device: torch.device) -> int | None:
    """Bytes a step allocates beyond what was live before it, at its peak (accelerators; ``None`` on CPU)."""
    if device.type == "cpu":
        return None
    _synchronize(device)
    before = torch.accelerator.memory_allocated(device)
    torch.accelerator.reset_peak_memory_stats(device)
    run()
    _synchronize(device)
    return int(torch.accelerator.max_memory_allocated(device) - before)


def _weights_bytes(model: Any) -> int:
    """Bytes of the distinct tensors the model holds (weights, the rotary table)."""
    seen: dict[int, int] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            seen.setdefault(value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        elif isinstance(value, torch.nn.Module):  # an imported model's pieces hold their weights as a module does
            for tensor in [*value.parameters(), *value.buffers()]:
                visit(tensor, depth + 1)
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and hasattr(value, "__dict__") and not isinstance(value, type):
            for item in vars(value).values():
                visit(item, depth + 1)

    visit(model, 0)
    return sum(seen.values())


def _memory(runtime: Any, model: Any, kv: KVCache, phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    tiers = []
    for tier in runtime.platform.memory_tiers:
        allocator = runtime.allocator(tier)
        free, total = allocator.mem_info()
        stats = allocator.stats()
        tiers.append(
            {
                "tier": tier,
                "allocator": allocator.name,
                "free_bytes": free,
                "total_bytes": total,
                "allocated_bytes": stats.allocated,
                "peak_bytes": stats.peak,
                "live_buffers": stats.live_buffers,
            }
        )
    pool = kv.pool
    return {
        "tiers": tiers,
        "kv_cache": {
            "tier": "device",
            "block_size": kv.layout.block_size,
            "block_bytes": kv.layout.block_bytes,
            "blocks": kv.num_blocks,
            "blocks_used": kv.num_blocks - pool.num_free,
            "blocks_free": pool.num_free,
            "bytes": kv.num_blocks * kv.layout.block_bytes,
        },
        "weights_bytes": _weights_bytes(model),
        "step_peak_bytes": {phase: report["step_peak_bytes"] for phase, report in phases.items()},
    }


def _graph_group(
    flat: FlatModel, trace_s: dict[str, float], compiled: dict[str, Any] | None, phases: Sequence[str]
) -> dict[str, Any]:
    graphs = {}
    for phase in phases:
        graph = flat.graph(phase)
        graphs[phase] = {
            "counts": graph.counts(),
            "fusions": dict(graph.fusions),
            "digest": graph.digest(),
            "trace_s": trace_s[phase],
        }
    return {
        "mode": "eager",
        # a flat graph is traced whole or not at all (trace raises TraceError): it has no breaks
        "graph_breaks": 0 if compiled is None else compiled["graph_breaks"],
        "phases": graphs,
        "compile": compiled,
    }


def _compile(
    model: Any,
    runtime: Any,
    dtype: torch.dtype,
    block_size: int,
    steps: dict[str, _Step],
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    min_run_time: float,
) -> dict[str, Any]:
    """Compile each phase with the ``vllm_port`` backend: seconds, pieces, graph breaks and the compiled step's time."""
    from torch._dynamo.utils import counters

    compiled = FlatModel(model, runtime, dtype, compile=True, block_size=block_size)
    breaks_before = sum(counters["graph_break"].values())
    phases = {}
    for phase, step in steps.items():

        def run(step: _Step = step) -> torch.Tensor:
            hidden = compiled.forward(step.input_ids, step.positions, caches, step.meta)
            return compiled.compute_logits(hidden.index_select(0, step.logits_rows))

        began = time.perf_counter()
        run()
        _synchronize(runtime.device)
        first_call_s = time.perf_counter() - began
        step_us, spread, _ = _wall_time(run, min_run_time)
        phases[phase] = {"first_call_s": first_call_s, "step_time_us": step_us, "step_spread_us": spread}
    reports = compiled.backend.reports
    return {
        "compiler": reports[0].compiler if reports else None,
        "seconds": sum(r.seconds for r in reports),
        "graphs": len(reports),
        "pieces": sum(r.pieces for r in reports),
        "eager_pieces": sum(r.eager_pieces for r in reports),
        "trivial_pieces": sum(r.trivial_pieces for r in reports),
        "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
        "phases": phases,
    }
