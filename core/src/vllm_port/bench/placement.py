"""Decode tokens/s of a model too large for its device budget, with its MLPs (or LM head) placed on the host.

One run builds (or takes with ``--model``) a random-weight Llama checkpoint, and runs the same
greedy requests through ``LLM.generate``:

- ``host``: the whole model on the host platform (``--host``, the CPU);
- ``placed``: the model on the device platform (``--device``, the best available one) with the
  parts named by ``--place`` (``mlp``, ``lm_head`` or both) on the host, under a device budget
  (``--device-budget`` GiB): where torch's allocator for the device type can be capped
  (``set_per_process_memory_fraction`` of the device type's torch module) the budget is enforced, so the whole model
  could not load there; elsewhere it is reported beside the weights the device holds;
- ``device``: the whole model on the device, only when its weights fit the budget.

For each batch size, decode tokens/s is the batch's output tokens after the first over the time
after the first (a run of one output token gives the prefill's time). The first run at a batch size
is reported apart (``cold_step_ms``) and the rate comes from the runs after it (the median of
``--repeats``): a model that is not captured as device graphs (a placed one) meets each new batch
size in its first run, and what a platform compiles or tunes per shape then (Triton specialises
its kernels on sizes) lands there, not in the steady state. Each row also says the most sequences a
decode step ran (fewer than the batch: the KV cache held fewer, flagged). Prints a markdown table.
``--shape tiny`` runs on any machine in seconds (the tests do, with two platforms on the CPU).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ._decode import decode_rate, time_decode, warm_up
from .engine import CPU_WORKLOAD, H200_WORKLOAD, Workload, build_model

__all__ = ["SHAPES", "main", "run"]

SHAPES: dict[str, Workload] = {
    "llama3-8b": replace(H200_WORKLOAD, max_position_embeddings=2048),
    "small": CPU_WORKLOAD,
    "tiny": Workload(
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    ),
}
_PARTS = ("mlp", "lm_head")


def policy_for(place: str, host: str) -> dict[str, Any]:
    """The placement policy: each part of ``place`` (``"mlp"``, ``"lm_head"``, ``"mlp,lm_head"``) on ``host``."""
    parts = [p for p in place.split(",") if p]
    bad = [p for p in parts if p not in _PARTS]
    if bad or not parts:
        raise ValueError(f"--place {place!r}: give one or both of {', '.join(_PARTS)}, comma-separated")
    return {"rules": [{"label": f"{part} on the host", "platform": host, "part": part} for part in parts]}


def _weight_bytes(w: Workload, parts: str) -> dict[str, int]:
    """Bytes of the whole model, and of the parts that ``parts`` moves to the host."""
    item = torch.empty((), dtype=getattr(torch, w.dtype)).element_size()
    head = w.hidden_size // w.num_heads
    attn = w.hidden_size * (w.num_heads + 2 * w.num_kv_heads) * head + w.num_heads * head * w.hidden_size
    mlp = 3 * w.hidden_size * w.intermediate_size * w.num_layers
    table = w.vocab_size * w.hidden_size
    total = (w.num_layers * (attn + 2 * w.hidden_size) + mlp + 2 * table + w.hidden_size) * item
    moved = (mlp if "mlp" in parts else 0) + (table if "lm_head" in parts else 0)
    return {"total": total, "moved": moved * item}


def _cap_device(device_type: str, budget: int) -> str:
    """Cap torch's allocator for ``device_type`` at ``budget`` bytes where torch can; say what was done."""
    module = getattr(torch, device_type, None)
    cap = getattr(module, "set_per_process_memory_fraction", None)
    if device_type == "cpu" or cap is None or not module.is_available():
        return "reported, not enforced (no allocator cap for this device type)"
    total = module.get_device_properties(0).total_memory
    cap(min(1.0, budget / total), 0)
    return f"enforced: torch.{device_type}.set_per_process_memory_fraction({budget / total:.4f})"


def _decode_rate(llm: Any, w: Workload, batch: int, seed: int = 1, repeats: int = 3) -> dict[str, float]:
    """Decode rate at ``batch``: the first run at this batch size apart, then the median of ``repeats`` more."""
    import statistics

    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, w.vocab_size, (batch, w.prompt_len), generator=g).tolist()

    most = 0  # the most sequences a decode step ran: fewer than the batch means the KV cache held fewer
    execute = llm.runner.execute

    def counting(batch: Any) -> list[int]:
        nonlocal most
        if batch.is_decode:
            most = max(most, len(batch.query_lens))
        return execute(batch)

    # load and first use with one sequence, so that the first run at this batch size is the next one
    warm_up(llm, prompts, num_prompts=1, max_tokens=2)
    llm.runner.execute = counting  # an instance attribute over the method, for these runs only
    try:
        # the first decode steps at this batch size: whatever compiles per shape runs here
        cold = time_decode(llm, prompts, w.output_len).decode_s
        decode = statistics.median(time_decode(llm, prompts, w.output_len).decode_s for _ in range(max(1, repeats)))
    finally:
        del llm.runner.execute
    return {
        "batch": batch,
        **decode_rate(batch, w.output_len, decode),
        "cold_step_ms": decode_rate(batch, w.output_len, cold)["step_ms"],
        "decode_seqs": most,
    }


def run(
    model_dir: str | None,
    shape: str = "tiny",
    device: str = "auto",
    host: str = "cpu",
    place: str = "mlp",
    device_budget_gib: float | None = None,
    batches: tuple[int, ...] = (1, 8),
    prompt_len: int = 32,
    output_len: int = 16,
    layers: int | None = None,
    save_model: str | None = None,
    kv_cache_bytes: int = 1 << 30,
    repeats: int = 3,
) -> dict[str, Any]:
    """Measure the rows of the module docstring; return them with the setup."""
    import tempfile

    from ..engine import LLM
    from ..placement import load_many

    w = replace(SHAPES[shape], prompt_len=prompt_len, output_len=output_len, num_requests=max(batches))
    if layers is not None:
        w = replace(w, num_layers=layers)
    platforms = load_many([device, host], sources={host: "--host"} if host != device else None)
    if len(platforms) < 2:
        raise ValueError(f"--device {device!r} and --host {host!r} are one platform; name two platforms")
    device_name = platforms.default.platform.name
    device_type = platforms.default.platform.device_type
    sizes = _weight_bytes(w, place)
    budget = int(device_budget_gib * 2**30) if device_budget_gib else None
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(model_dir or save_model or scratch)
        if not (path / "config.json").is_file():
            build_model(path, w, 0, device_type)
        capped = _cap_device(device_type, budget) if budget else "none"
        # room for every sequence of the largest batch in whole blocks (CUDA's hold 128 tokens), K and V of every
        # layer, at most 4 bytes an element and as many heads as the model has (at least its KV heads)
        block = max(runtime.platform.kv_block_size for runtime in platforms.values())
        per_sequence = -(-(prompt_len + output_len) // block) * block
        kv = min(kv_cache_bytes, max(batches) * per_sequence * 2 * w.num_layers * w.hidden_size * 4)
        common = dict(
            dtype=w.dtype,
            max_model_len=prompt_len + output_len,
            max_num_seqs=max(batches),
            kv_cache_memory=kv,
            enable_prefix_caching=False,
            seed=0,
        )
        rows: list[dict[str, Any]] = []
        configs = [("host", f"all on {host}", dict(device=host))]
        configs.append(
            (
                "placed",
                f"{place} on {host}, rest on {device_name}",
                dict(placement=policy_for(place, host), devices=[device_name, host]),
            ),
        )
        if budget is None or sizes["total"] <= budget:
            configs.append(("device", f"all on {device_name}", dict(device=device_name, enforce_eager=True)))
        for key, label, kwargs in configs:
            llm = LLM(str(path), **common, **kwargs)
            try:
                on_device = llm.placement.model.weights.bytes.get(device_name, 0) if llm.placement else None
                for batch in batches:
                    rows.append(
                        {
                            "config": key,
                            "label": label,
                            "device_weight_bytes": on_device,
                            **_decode_rate(llm, w, batch, repeats=repeats),
                        }
                    )
            finally:
                llm.close()
    return {
        "shape": shape,
        "workload": {k: v for k, v in w.__dict__.items() if k != "decode_batches"},
        "device": device_name,
        "host": host,
        "place": place,
        "weights_bytes": sizes["total"],
        "moved_bytes": sizes["moved"],
        "device_budget_bytes": budget,
        "budget": capped,
        "whole_model_fits": budget is None or sizes["total"] <= budget,
        "repeats": repeats,
        "rows": rows,
    }


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def render(result: dict[str, Any]) -> str:
    """The result as a markdown table, with the setup above it."""
    budget = result["device_budget_bytes"]
    lines = [
        f"model: {result['shape']} ({_size(result['weights_bytes'])} of weights, "
        f"{_size(result['moved_bytes'])} of them in {result['place']})",
        f"device budget: {'none' if budget is None else _size(budget)} ({result['budget']}); "
        f"whole model fits: {'yes' if result['whole_model_fits'] else 'no'}",
        "",
        f"step ms: the median of {result.get('repeats', 1)} runs after the first at each batch size; "
        "first run: the first decode steps at that batch size (what compiles per shape lands there)",
        "",
        "| config | batch | seqs a step | decode tok/s | step ms | first run step ms | weights on device "
        "| vs all on host |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    host = {r["batch"]: r["decode_tok_s"] for r in result["rows"] if r["config"] == "host"}
    for r in result["rows"]:
        on_device = "-" if r["device_weight_bytes"] is None else _size(r["device_weight_bytes"])
        ratio = r["decode_tok_s"] / host[r["batch"]] if host.get(r["batch"]) else float("nan")
        lines.append(
            f"| {r['label']} | {r['batch']} | {r.get('decode_seqs', '?')} | {r['decode_tok_s']:,.1f} | "
            f"{r['step_ms']:,.1f} | "
            f"{r.get('cold_step_ms', float('nan')):,.1f} | {on_device} | {ratio:.2f}x |"
        )
    short = [r for r in result["rows"] if r.get("decode_seqs", r["batch"]) < r["batch"]]
    for r in short:
        lines.append(
            f"warning: {r['label']} at batch {r['batch']} decoded at most {r['decode_seqs']} sequences a step "
            "(its KV cache held fewer): its step time is not the batch's"
        )
    return "\n".join(lines)


def main(args: Any) -> int:
    result = run(
        args.model,
        args.shape,
        args.device,
        args.host,
        args.place,
        args.device_budget,
        tuple(int(b) for b in args.batches.split(",")),
        args.prompt_len,
        args.output_len,
        args.layers,
        args.save_model,
        repeats=args.repeats,
    )
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
