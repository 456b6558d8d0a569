"""Time every node of a model's decode and prefill steps under ``torch.profiler`` and group the times by stack layer.

:func:`profile_model` orchestrates: it traces each phase's flat graph, allocates the KV cache the
steps read, builds the steps (:mod:`.steps`), times them (:mod:`.timing`), groups the times and
measures memory and compilation (:mod:`.report`), and stamps the report with what a baseline must
share (:mod:`.model`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..bench._timing import load_average
from ..flat import FlatModel
from ..memory import KVLayout
from .report import _compile, _graph_group, _memory, _phase_report
from .schema import FORMAT, PHASES, SCHEMA_VERSION, ProfileError
from .steps import _batch, _make_step
from .subject import _versions, identity
from .timing import CAPTURED_PHASE, _device_activity, _graph_capture, _timer_note

__all__ = ["fill_like_a_prefill", "profile_model"]


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


def fill_like_a_prefill(caches: Sequence[tuple[torch.Tensor, torch.Tensor]], seed: int = 0) -> None:
    """Random keys and values (a unit normal, in the caches' dtype) in every slot, as a prefill would leave them.

    A fresh allocation's pages that nothing wrote read as zeros: on a CPU, from one shared page of the
    kernel's, so a decode step's attention over them reads from cache. Measured on the 2-core dev box (the
    engine's model, batch 64, context 192): 0.63 ms a call over untouched caches, 1.6 ms in a running engine.
    """
    for pair in caches:
        for cache in pair:
            gen = torch.Generator(cache.device).manual_seed(seed)
            for block in range(0, cache.shape[0], 256):  # a slab at a time: no float32 copy of a whole cache
                slab = cache[block : block + 256]
                slab.copy_(torch.randn(slab.shape, generator=gen, device=cache.device))
            seed += 1


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
    progress: Callable[[str], None] | None = None,
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
    :param progress: told each stage as it starts (``"tracing the decode step into a flat graph"``): the
        command shows them, since a profile takes seconds to minutes.
    :raises ProfileError: for options the model cannot run (a context past its positions).
    """
    dtype = dtype or model.dtype
    block_size = block_size or runtime.platform.kv_block_size
    _check_options(model, batch, context, repeats, phases)
    say = progress or (lambda stage: None)
    device = runtime.device
    flat = FlatModel(model, runtime, dtype, compile=False, block_size=block_size)
    trace_s = {}
    for phase in phases:
        say(f"tracing the {phase} step into a flat graph")
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
        fill_like_a_prefill(caches)
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
                say(f"timing the {phase} step: {repeats} profiled, {min_run_time:g} s of wall time")
                reports[phase], found = _phase_report(step, repeats, activity, device, min_run_time, capture)
                collectives += [{"phase": phase, **f} for f in found]
            if compile:
                say("compiling each step with the vllm_port backend")
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
