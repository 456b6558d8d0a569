"""Timing a step: its wall time, its replay as the engine captures it, and its nodes in one profiler session.

One profiler session runs ``repeats`` steps; each node's time is the median over them, and its
spread half their interquartile range, so a comparison against a baseline can tell change from noise.

A node's time is its device time where the platform has profiler device activity (CUDA and ROCm
through CUPTI/roctracer, XPU), its host time otherwise (CPU). On a device each range ends with a
synchronisation and device work is given to the range it ran in by time stamp
(:mod:`vllm_port.profile.timeline`: the profiler's own links miss Triton's launches). The step's
wall time comes from ``torch.utils.benchmark`` on the plain step, unprofiled; the sum of node times
over it is how much of the step the profile explains.

Run node by node, a step on a GPU waits mostly on the host's dispatch between nodes, which the
engine does not pay: it replays decode steps captured as device graphs. Where the platform
captures graphs, the plain decode step is also captured the engine's way (the platform's
:class:`~vllm_port.graph_capture.GraphCapture`, inside :func:`~vllm_port.graph_capture.capturing`) and its replay
timed by the same clock, so the node times are held against the step the engine runs as well.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.profiler import ProfilerActivity, record_function

from ..errors import VllmPortError
from ..graph_capture import GraphCapture, capturing
from .steps import LABEL, _Step, _synchronize, collective_name
from .timeline import Attribution, attribute_device_work

__all__ = ["CAPTURED_PHASE"]


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


def _timer_note(timer: str, activity: ProfilerActivity | None, device: torch.device) -> str:
    if timer == "device":
        return (
            f"device time: the device work ({activity.name} activity of torch.profiler) that ran inside each "
            "node's range, each range closed by a synchronisation"
        )
    if activity is not None:
        return f"host time: torch.profiler recorded no {activity.name} kernel time on {device}"
    return f"host time: torch.profiler has no device activity for {device.type} (record_function ranges)"
