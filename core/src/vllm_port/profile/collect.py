"""Time every node of a model's decode and prefill steps under ``torch.profiler`` and group the times by stack layer.

The steps are the flat graphs :class:`~vllm_port.flat.FlatModel` runs eagerly (after the fusion
passes), followed by what a runner does after the graph: pick the rows that need logits and run the
LM head. A copy of each graph's eager module has every kernel node wrapped in a
``torch.profiler.record_function`` range named after the node; the plain graph is left untouched,
so profiling costs nothing when it is off. One profiler session runs ``repeats`` steps; each node's
time is the median over them, and its spread half their interquartile range, so a comparison
against a baseline can tell change from noise.

A node's time is its device time where the platform has profiler device activity (CUDA and ROCm
through CUPTI/roctracer, XPU), its host time otherwise (CPU). On a device each range ends with a
synchronisation and device work is given to the range it ran in by time stamp
(:mod:`vllm_port.profile.timeline`: the profiler's own links miss Triton's launches). The step's wall time comes from ``torch.utils.benchmark`` on the plain
step, unprofiled; the sum of node times over it is how much of the step the profile explains.

Run node by node, a step on a GPU waits mostly on the host's dispatch between nodes, which the
engine does not pay: it replays decode steps captured as device graphs. Where the platform
captures graphs, the plain decode step is also captured the engine's way (the platform's
:class:`~vllm_port.graph.GraphCapture`, inside :func:`~vllm_port.graph.capturing`) and its replay
timed by the same clock, so the node times are held against the step the engine runs as well.
"""

from __future__ import annotations

import copy
import hashlib
import json
import platform as host_platform
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.profiler import ProfilerActivity, record_function

from ..bench._timing import load_average
from ..errors import VllmPortError
from ..flat import FlatGraph, FlatModel, graph_inputs
from ..flat.trace import StepInputs
from ..graph import GraphCapture, capturing
from ..memory import KVCache, KVLayout
from .schema import FORMAT, IMPORTERS, PHASES, SCHEMA_VERSION, STACK_LAYERS, ProfileError
from .timeline import Attribution, attribute_device_work

__all__ = ["collective_name", "identity", "importer_of", "load_profile_model", "profile_model"]

#: Prefix of every profiler range this module opens.
LABEL = "vllm_port.profile"
#: Collective calls as torch.distributed and the collective libraries spell them, without underscores.
_COLLECTIVES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}
_COLLECTIVE = re.compile("|".join(sorted(_COLLECTIVES, key=len, reverse=True)))
#: Who issues collectives: torch.distributed (``c10d::``, traced ``_c10d_functional``) and the libraries.
_COMM_LIBRARY = re.compile(r"^(_?c10d|nccl|rccl|gloo|xccl|oneccl|ccl)", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------
# Steps: inputs, the plain step, the instrumented step
# ------------------------------------------------------------------------------------------------


@dataclass
class _Step:
    """One phase's step: its inputs, its nodes and the two ways to run it (plain, and with a range per node)."""

    phase: str
    logits_rows: torch.Tensor
    run: Callable[[], torch.Tensor]
    run_ranged: Callable[[], torch.Tensor]
    nodes: list[dict[str, Any]]
    meta: StepInputs
    input_ids: torch.Tensor
    positions: torch.Tensor


def _batch(
    phase: str, tables: torch.Tensor, context: int, block_size: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, StepInputs, torch.Tensor]:
    """``(input_ids, positions, meta, logits_rows)``: each sequence prefills ``context`` tokens or decodes its last."""
    batch = tables.shape[0]
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    if phase == "decode":
        positions = torch.full((batch,), context - 1, dtype=torch.int64)
        per_seq = 1
    else:
        positions = torch.arange(context, dtype=torch.int64).repeat(batch)
        per_seq = context
    seq_of_token = torch.arange(batch).repeat_interleave(per_seq)
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    cu_seqlens = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32)
    ids = torch.randint(0, vocab_size, (batch * per_seq,), generator=gen)
    meta = StepInputs(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=seq_lens.to(device),
        cu_seqlens_q=cu_seqlens.to(device),
        max_query_len=per_seq,
        is_decode=phase == "decode",
    )
    return ids.to(device), positions.to(device), meta, (cu_seqlens[1:] - 1).to(device)


def _ranged(label: str, fn: Callable[..., Any], sync: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``fn`` run inside a profiler range called ``label``; ``sync`` (the device's) ends the range after its work."""

    def ranged(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            out = fn(*args, **kwargs)
            if sync is not None:
                sync()
            return out

    ranged.__name__ = ranged.__qualname__ = re.sub(r"\W", "_", label)  # fx code generation needs identifiers
    return ranged


def _instrumented(graph: FlatGraph, sync: Callable[[], None] | None = None) -> fx.GraphModule:
    """A copy of ``graph``'s eager module whose kernel nodes (every node but shape arithmetic) run in ranges."""
    module = graph.eager_module()
    by_fx_name = {graph.fx_node(n.name).name: n for n in graph.nodes if n.kind != "shape"}
    wrapped = 0
    for node in module.graph.nodes:  # the eager module's graph is a copy: fx keeps the node names
        flat = by_fx_name.get(node.name) if node.op == "call_function" else None
        if flat is not None:
            node.target = _ranged(f"{LABEL}/{graph.phase}/{flat.name}", node.target, sync)
            wrapped += 1
    if wrapped != len(by_fx_name):
        raise ProfileError(
            f"profile: {len(by_fx_name) - wrapped} nodes of the {graph.phase} graph were not found in its eager "
            "module (FlatGraph.eager_module renamed them); the profile would miss their time"
        )
    module.recompile()
    return module


def _node_record(name: str, op: str, kind: str, provider: str, plugin: str, layer: int | None) -> dict[str, Any]:
    stack = "ops" if kind in ("contract", "plugin") else ("comm" if collective_name(op) else "graph")
    return {
        "name": name,
        "op": op,
        "kind": kind,
        "provider": provider,
        "plugin": plugin,
        "layer": layer,
        "stack_layer": stack,
    }


def _make_step(flat: FlatModel, phase: str, caches: list[tuple[torch.Tensor, torch.Tensor]], inputs: tuple) -> _Step:
    ids, positions, meta, rows = inputs
    graph = flat.graph(phase)
    args = graph_inputs(ids, positions, caches, meta)
    sync = None if ids.device.type == "cpu" else (lambda: _synchronize(ids.device))
    ranged_graph = _instrumented(graph, sync)
    select = _ranged(f"{LABEL}/{phase}/logits_rows", torch.index_select, sync)
    lm_head, head_nodes = _lm_head(flat, phase, sync)

    def run() -> torch.Tensor:
        return flat.compute_logits(graph(*args).index_select(0, rows))

    def run_ranged() -> torch.Tensor:
        return lm_head(select(ranged_graph(*args), 0, rows))

    nodes = [
        _node_record(n.name, n.op, n.kind, n.provider, n.plugin, n.layer) for n in graph.nodes if n.kind != "shape"
    ]
    # after the graph, as the engine's runner does: the rows that need logits, then the LM head
    nodes.append(_node_record("logits_rows", str(torch.ops.aten.index_select.default), "native", "torch", "", None))
    nodes += head_nodes
    return _Step(phase, rows, run, run_ranged, nodes, meta, ids, positions)


def _lm_head(
    flat: FlatModel, phase: str, sync: Callable[[], None] | None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[dict[str, Any]]]:
    """The LM head as the runner runs it after the graph (logits of hidden rows), in ranges, and its nodes.

    A core model's head is one ``linear``: the node ``lm_head``. An imported model's head is the
    piece the importer rewrote from the causal LM's forward after its base model (an fx graph,
    ``ImportedModel.lm_head``): its ``linear`` is the node ``lm_head`` and every other call in it
    (a view; Gemma-2's final soft cap, which the importer leaves as native torch ops) a node of its
    own, ``lm_head.<name>``, so that what the importer left native is timed as in the layers.
    """
    linear = flat.kernels.providers["linear"]
    head = _node_record("lm_head", "linear", "contract", linear.name, linear.plugin, None)
    piece = getattr(flat.model, "lm_head", None)
    if importer_of(flat.model) is None or not isinstance(piece, fx.GraphModule):
        return _ranged(f"{LABEL}/{phase}/lm_head", flat.compute_logits, sync), [head]
    from ..importer._contract import CONTRACT_CALLS  # the calls a rewritten piece makes for contract ops

    ranged_piece = fx.GraphModule(piece, copy.deepcopy(piece.graph))  # shares the piece's weights
    nodes: list[dict[str, Any]] = []
    for node in ranged_piece.graph.nodes:
        if node.op != "call_function":
            continue
        ops = CONTRACT_CALLS.get(node.target, ())
        if ops == ("linear",) and head not in nodes:
            record = head
        elif len(ops) == 1:
            provider = flat.kernels.providers[ops[0]]
            record = _node_record(f"lm_head.{node.name}", ops[0], "contract", provider.name, provider.plugin, None)
        else:
            record = _node_record(f"lm_head.{node.name}", str(node.target), "native", "torch", "", None)
        node.target = _ranged(f"{LABEL}/{phase}/{record['name']}", node.target, sync)
        nodes.append(record)
    if head not in nodes:
        raise ProfileError(
            f"profile: the imported LM head ({type(flat.model).__name__}.lm_head) calls no contract linear; the "
            "profile cannot tell which node is the head's (inspect it with vllm-port inspect MODEL_DIR --import)"
        )
    ranged_piece.recompile()
    ranged_model = copy.copy(flat.model)  # shallow: the same layers and weights, the ranged head
    ranged_model.lm_head = ranged_piece

    def lm_head(hidden: torch.Tensor) -> torch.Tensor:
        return ranged_model.compute_logits(flat.kernels, hidden)

    return lm_head, nodes


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------


def _device_activity(device: torch.device) -> ProfilerActivity | None:
    """The profiler activity that records ``device``'s kernels, or ``None`` (CPU, or none this torch supports)."""
    if device.type == "cpu":
        return None
    names = {"cuda": "CUDA", "xpu": "XPU", "mtia": "MTIA", "hpu": "HPU"}
    name = names.get(device.type)
    if name is None and device.type == torch._C._get_privateuse1_backend_name():
        name = "PrivateUse1"
    activity = getattr(ProfilerActivity, name or "", None)
    return activity if activity in torch.profiler.supported_activities() else None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _spread(samples: Sequence[float]) -> float:
    """Half the interquartile range (0 for fewer than two samples)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / 2


def _wall_time(run: Callable[[], Any], min_run_time: float) -> tuple[float, float, int]:
    """``(median, spread, calls)`` of the step's wall time in microseconds, one call per sample.

    ``timeit`` with ``torch.utils.benchmark``'s clock, which synchronises the accelerator (as a
    runner does before it samples). Single calls, not blocks of them: on a shared host a preemption
    then spoils a few samples, which the median leaves out, instead of every block it falls into.
    """
    import timeit

    from torch.utils.benchmark.utils.timer import timer as synchronising_clock

    clock = timeit.Timer(run, timer=synchronising_clock)
    one = max(clock.timeit(number=1), 1e-6)
    calls = int(min(max(min_run_time / one, 10), 10_000))
    times = [t * 1e6 for t in clock.repeat(repeat=calls, number=1)]
    return statistics.median(times), _spread(times), calls


#: The phase the engine captures (prefill's token count changes with every batch: it runs eagerly).
CAPTURED_PHASE = "decode"


def _graph_capture(runtime: Any) -> tuple[GraphCapture | None, str]:
    """The platform's graph capture as the engine's runner gets it, or ``None`` and why there is none."""
    if not runtime.platform.graph_capture:
        return None, (
            f"platform {runtime.platform.name!r} has no graph capture (graph_capture=False): the engine runs "
            "every step eagerly there"
        )
    try:
        return runtime.graph_capture(), ""
    except VllmPortError as exc:
        return None, f"no graph capture: {exc}"


def _captured_step_time(step: _Step, capture: GraphCapture | None, why_not: str, min_run_time: float) -> dict[str, Any]:
    """The plain step captured as the engine captures decode steps, and its replay's wall time (``None``: why not).

    Never raises for a capture that fails: the profile stands without this number, and the note says why.
    """
    found: dict[str, Any] = {
        "captured_step_time_us": None,
        "captured_step_spread_us": None,
        "captured_step_calls": 0,
        "captured_with": None,
        "captured_note": why_not,
    }
    if step.phase != CAPTURED_PHASE:
        found["captured_note"] = f"the engine captures {CAPTURED_PHASE} steps only; a {step.phase} step runs eagerly"
        return found
    if capture is None:
        return found
    name = getattr(capture, "name", type(capture).__name__)
    try:
        # as the runner's DecodeGraphs does: inference mode, and host-reading checks stand aside while recording
        with torch.inference_mode(), capturing():
            replay = capture.capture(step.run, warmup=2)
        with torch.inference_mode():
            us, spread, calls = _wall_time(replay, min_run_time)  # its clock synchronises, as the step's does
    except Exception as exc:  # any failure of a vendor's capture: reported, and the profile goes on
        found["captured_note"] = (
            f"capturing or replaying the {step.phase} step with {name} failed ({type(exc).__name__}: {exc}); the engine "
            "captures its decode steps the same way (LLM(..., enforce_eager=True) runs them without capture)"
        )
        return found
    found.update(
        captured_step_time_us=us,
        captured_step_spread_us=spread,
        captured_step_calls=calls,
        captured_with=name,
        captured_note="",
    )
    return found


def _profiled(
    step: _Step, repeats: int, activity: ProfilerActivity | None, device: torch.device
) -> tuple[dict[str, list[float]], Attribution, list[float], list[float], list[dict[str, Any]]]:
    """Per node label: host times (µs) of each repeat, and the device work given to each; each profiled step's
    host time and the part of it outside every node; collectives seen."""
    activities = [ProfilerActivity.CPU] + ([activity] if activity is not None else [])
    step_label = f"{LABEL}/{step.phase}/step"
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(repeats):
            with record_function(step_label):
                step.run_ranged()
        _synchronize(device)
    host: dict[str, list[float]] = {}
    steps: list[float] = []
    gaps: list[float] = []
    comm: list[dict[str, Any]] = []
    prefix = f"{LABEL}/{step.phase}/"
    ranges: list[tuple[float, float, str]] = []
    device_work: list[tuple[float, float]] = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            # device-side copies of host ranges (ours, nccl:all_reduce...) are spans, not work
            if not getattr(event, "is_user_annotation", False) and not event.name.startswith(LABEL):
                device_work.append((event.time_range.start, event.time_range.end))
            continue
        if event.name == step_label:
            steps.append(event.cpu_time_total)
            in_nodes = sum(c.cpu_time_total for c in event.cpu_children if c.name.startswith(prefix))
            gaps.append(event.cpu_time_total - in_nodes)
        elif event.name.startswith(prefix):
            label = event.name[len(prefix) :]
            host.setdefault(label, []).append(event.cpu_time_total)
            ranges.append((event.time_range.start, event.time_range.end, label))
        elif collective_name(event.name):
            comm.append({"name": event.name, "host_us": event.cpu_time_total, "device_us": event.device_time_total})
    return host, attribute_device_work(ranges, device_work), steps, gaps, comm


def collective_name(name: str) -> str | None:
    """The collective a profiler event or graph op name stands for (``"all_reduce"``), or ``None``.

    Matches the spellings of torch.distributed (``c10d::allreduce_``) and of the collective libraries
    (``nccl:all_reduce``, ``gloo:all_gather``); contract and torch compute ops never match.
    """
    if not _COMM_LIBRARY.match(name):
        return None
    found = _COLLECTIVE.search(name.lower().replace("_", ""))
    return _COLLECTIVES[found.group(0)] if found else None


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


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def _device_name(runtime: Any) -> str:
    probe = runtime.selected.probe
    if runtime.device.type != "cpu" and probe is not None and probe.devices:
        return probe.devices[0].name
    return host_platform.processor() or host_platform.machine()


def importer_of(model: Any) -> str | None:
    """The importer that made ``model``: ``"hf"`` for a ``transformers`` model imported by
    :func:`vllm_port.importer.import_model`, ``None`` for a core model definition."""
    from ..importer.model import ImportedModel  # no transformers import: the importer loads it only to import

    return "hf" if isinstance(model, ImportedModel) else None


def load_profile_model(
    model_dir: str | Path, runtime: Any, dtype: torch.dtype | None = None, importer: str | None = None
) -> Any:
    """The model ``vllm-port profile MODEL_DIR [--importer hf]`` profiles, on ``runtime``'s device.

    :param dtype: default the checkpoint's.
    :param importer: ``None`` for the core model definition (``vllm_port.models.load_model``);
        ``"hf"`` to load the directory with ``transformers`` and import it as ``LLM(model_dir,
        importer="hf")`` does (traced, rewritten into contract ops, checked against transformers).
    :raises ProfileError: for an unknown importer; ``ModelLoadError`` or ``ImporterError`` for a
        directory that cannot be loaded or imported.
    """
    if importer is None:
        from ..models import load_config, load_model

        return load_model(model_dir, runtime.device, dtype or load_config(model_dir).dtype)
    if importer not in IMPORTERS:
        raise ProfileError(
            f"profile: importer {importer!r} is unknown; use one of {', '.join(IMPORTERS)}, or none for the core model"
        )
    from ..importer.engine import load_hf_model
    from ..importer.model import import_model

    hf_model = load_hf_model(model_dir, dtype)
    # the imported model shares the module's weights; dropping the module frees those it fused (q/k/v, gate/up)
    return import_model(hf_model, runtime, dtype)


def identity(
    model: Any, runtime: Any, dtype: torch.dtype, batch: int, context: int, block_size: int | None = None
) -> dict[str, Any]:
    """What a profile must share with its baseline to be compared: model shape and who built it (the core
    definition or an importer), dtype, batch shape, platform.

    :param block_size: default the platform's ``kv_block_size``, as :func:`profile_model`'s.
    """
    c = model.config
    facts = {
        "architecture": c.architecture,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        # an imported model's config has none (ImportedConfig reads attention sizes from the traced graph)
        "intermediate_size": getattr(c, "intermediate_size", None),
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_size": c.head_size,
        "vocab_size": c.vocab_size,
    }
    facts["fingerprint"] = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "model": facts,
        "importer": importer_of(model),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"batch": batch, "context": context, "block_size": block_size or runtime.platform.kv_block_size},
        "platform": runtime.platform.name,
        "device": _device_name(runtime),
    }


def _check_options(model: Any, batch: int, context: int, repeats: int, phases: Sequence[str]) -> None:
    limit = model.config.max_position_embeddings
    if batch < 1:
        raise ProfileError(f"profile: --batch is {batch}; give at least 1 sequence")
    if not 1 <= context <= limit:
        raise ProfileError(
            f"profile: --context is {context}; the model takes 1 to {limit} positions "
            "(max_position_embeddings in its config.json): give a context in that range"
        )
    if repeats < 1:
        raise ProfileError(f"profile: --repeats is {repeats}; profile at least 1 step")
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise ProfileError(f"profile: phases {list(phases)!r}; choose from {', '.join(PHASES)}")


def profile_model(
    model: Any,
    runtime: Any,
    dtype: torch.dtype | None = None,
    *,
    batch: int = 8,
    context: int = 256,
    phases: Sequence[str] = PHASES,
    repeats: int = 10,
    block_size: int | None = None,
    compile: bool = False,
    min_run_time: float = 0.5,
    model_dir: str = "",
) -> dict[str, Any]:
    """Profile ``model`` on ``runtime``: every node of each phase's step, grouped by stack layer (JSON-ready).

    :param model: a core model (``vllm_port.models.load_model``) or an imported one
        (``vllm_port.importer.import_model``; :func:`load_profile_model` loads either from a directory);
        the report's ``importer`` says which, and a baseline must share it.
    :param batch: sequences in the step; :param context: tokens per sequence: a prefill step computes
        all of them, a decode step the last one with the others in the KV cache.
    :param repeats: steps profiled; each node's time is the median over them.
    :param compile: also compile each phase with the ``vllm_port`` backend and report the graph
        layer's compile time, pieces and graph breaks, and the compiled step's time.
    :param min_run_time: seconds spent timing each plain step's wall time.
    :param block_size: tokens per KV-cache block; default the platform's ``kv_block_size`` (the engine's layout).
    :raises ProfileError: for options the model cannot run (a context past its positions).
    """
    dtype = dtype or model.dtype
    block_size = block_size or runtime.platform.kv_block_size
    _check_options(model, batch, context, repeats, phases)
    device = runtime.device
    flat = FlatModel(model, runtime, dtype, compile=False, block_size=block_size)
    trace_s = {}
    for phase in phases:
        began = time.perf_counter()
        flat.graph(phase)
        trace_s[phase] = time.perf_counter() - began
    c = model.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_size, block_size, dtype)
    blocks_per_seq = -(-context // block_size)
    kv = runtime.kv_cache(layout, batch * blocks_per_seq * layout.block_bytes)
    try:
        blocks = [kv.pool.allocate(blocks_per_seq) for _ in range(batch)]
        if any(b is None for b in blocks):
            raise ProfileError(
                f"profile: the KV cache of {kv.num_blocks} blocks (platform {runtime.platform.name!r}'s block pool) "
                f"cannot give {batch} sequences {blocks_per_seq} blocks each; lower --batch or --context"
            )
        tables = torch.tensor(blocks, dtype=torch.int32)
        caches = list(zip(kv.key_caches, kv.value_caches, strict=True))
        activity = _device_activity(device)
        capture = _graph_capture(runtime) if CAPTURED_PHASE in phases else (None, "")
        steps = {
            phase: _make_step(flat, phase, caches, _batch(phase, tables, context, block_size, c.vocab_size, device))
            for phase in phases
        }
        reports: dict[str, dict[str, Any]] = {}
        collectives: list[dict[str, Any]] = []
        with torch.no_grad():
            for phase, step in steps.items():
                reports[phase], found = _phase_report(step, repeats, activity, device, min_run_time, capture)
                collectives += [{"phase": phase, **f} for f in found]
            compiled = _compile(model, runtime, dtype, block_size, steps, caches, min_run_time) if compile else None
        memory = _memory(runtime, model, kv, reports)
    finally:
        kv.close()
    first = reports[phases[0]]
    comm_us = {p: sum(f["time_us"] for f in collectives if f["phase"] == p) for p in phases}
    return {
        "format": FORMAT,
        "version": SCHEMA_VERSION,
        "model_dir": model_dir,
        **identity(model, runtime, dtype, batch, context, block_size),
        "repeats": repeats,
        "timer": first["timer"],
        "timer_note": _timer_note(first["timer"], activity, device),
        "threads": torch.get_num_threads(),
        "host_load": load_average(),
        "versions": _versions(),
        "phase": phases[0],
        "nodes": first["nodes"],
        "step_time_us": first["step_time_us"],
        "explained": first["explained"],
        "phases": reports,
        "groups": {
            "graph": _graph_group(flat, trace_s, compiled, phases),
            "ops": {
                "phases": {
                    p: {"time_us": r["stack_layers"]["ops"]["time_us"], "providers": r["providers"]}
                    for p, r in reports.items()
                }
            },
            "memory": memory,
            "comm": {
                "world_size": 1,
                "collectives": collectives,
                "phases": {p: {"time_us": us} for p, us in comm_us.items()},
                "note": "" if collectives else "none: one device, no communicator in use",
            },
        },
    }


def _timer_note(timer: str, activity: ProfilerActivity | None, device: torch.device) -> str:
    if timer == "device":
        return (
            f"device time: the device work ({activity.name} activity of torch.profiler) that ran inside each "
            "node's range, each range closed by a synchronisation"
        )
    if activity is not None:
        return f"host time: torch.profiler recorded no {activity.name} kernel time on {device}"
    return f"host time: torch.profiler has no device activity for {device.type} (record_function ranges)"


def _versions() -> dict[str, str]:
    from .. import __version__

    return {"vllm-port": __version__, "torch": torch.__version__}
