"""A running engine's decode steps on the device's timeline: kernels' busy time against the steps' wall time.

    python3 dev/experiments/probe_engine_timeline.py MODEL_DIR [--batch 256] [--steps 20] [--json OUT]
    python3 dev/experiments/probe_engine_timeline.py MODEL_DIR --whole-run [--kv-cache-dtype fp8] [--json OUT]

``bench engine --h200``'s requests (``--batch`` of 512 random prompt tokens, 256 greedy output tokens) on
``MODEL_DIR`` with the engine's defaults. ``torch.profiler`` records ``--steps`` decode steps from the middle
of the decode phase, as the engine runs them (replayed graphs, a step ahead). Prints the window's wall time a
step, the device's busy time a step (the union of its kernels' and copies' intervals), the idle rest, and the
kernels that took the most time. Issue 30: at 256 sequences on an H100 the engine's step took 18.7 ms where
`vllm-port profile` replays the same step's graph in 14.7 ms.

``--whole-run`` profiles nothing: it times every step of the run instead, so the run's wall time splits into
its parts. Each launch records a device event behind its work; the time between one step's event and the
next's is that step's share of the device timeline (its kernels and any idle before them); an event recorded as the
launch begins tells the idle apart (the device waiting for the host to start the step). Steps are grouped
by what they hold: prefill only, prefill chunks with decode rows (mixed), decode at the full batch, decode
below it; and each group is split into replayed and eager steps. What is left of ``generate``'s wall time is
the host before the first launch and after the last step's event.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import torch


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main() -> None:
    from vllm_port import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--whole-run", action="store_true", help="time every step of the run (no profiler)")
    parser.add_argument(
        "--no-split", action="store_true", help="prefill_attention serves mixed steps' decode rows too (the old way)"
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.no_split:
        import vllm_port.engine.runner as runner_module

        runner_module._leading_decode_rows = lambda query_lens: 0
    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        max_model_len=args.prompt + args.output,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        kv_cache_dtype=args.kv_cache_dtype,
        seed=0,
    )
    gen = torch.Generator().manual_seed(1)
    vocab = llm.runner.model.config.vocab_size if hasattr(llm.runner.model, "config") else 32000
    prompts = [
        {"prompt_token_ids": torch.randint(0, vocab, (args.prompt,), generator=gen).tolist()} for _ in range(args.batch)
    ]
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runner = llm.runner
    on_gpu = runner.runtime.platform.device_type == "cuda"
    if args.whole_run:
        return whole_run(llm, prompts, args, on_gpu)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_gpu else [])
    prof = torch.profiler.profile(activities=activities)
    launch, seen, window = runner.launch, [0], {}
    first = args.output // 2

    def watched(batch, *a, **k):
        if batch.is_decode and len(batch.query_lens) == args.batch:
            seen[0] += 1
            if seen[0] == first:
                if on_gpu:
                    torch.cuda.synchronize()
                prof.start()
                window["start"] = time.perf_counter()
            elif seen[0] == first + args.steps:
                if on_gpu:
                    torch.cuda.synchronize()
                window["end"] = time.perf_counter()
                prof.stop()
        return launch(batch, *a, **k)

    runner.launch = watched
    llm.generate(prompts, SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True), use_tqdm=False)
    runner.launch = launch
    llm.close()
    wall_ms = (window["end"] - window["start"]) / args.steps * 1e3
    device, host = [], collections.Counter()
    by_kernel: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append((e.time_range.start, e.time_range.end))
            by_kernel[e.name[:90]] += e.time_range.end - e.time_range.start
        elif e.name in ("cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync"):
            host[e.name] += e.time_range.end - e.time_range.start
    busy_ms = busy_us(device) / 1e3 / args.steps
    result = {
        "batch": args.batch,
        "steps": args.steps,
        "wall_ms_per_step": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "idle_ms_per_step": wall_ms - busy_ms,
        "top_kernels_ms_per_step": {k: v / 1e3 / args.steps for k, v in by_kernel.most_common(15)},
        "host_calls_ms_per_step": {k: v / 1e3 / args.steps for k, v in host.items()},
    }
    print(
        f"batch {args.batch}, {args.steps} decode steps: {wall_ms:.2f} ms a step; device busy {busy_ms:.2f} ms, "
        f"idle {wall_ms - busy_ms:.2f} ms"
    )
    for name, ms in result["top_kernels_ms_per_step"].items():
        print(f"  {ms:8.3f} ms  {name}")
    for name, ms in result["host_calls_ms_per_step"].items():
        print(f"  host {name}: {ms:.3f} ms a step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


def step_group(batch, full: int) -> str:
    """What a step holds: ``prefill``, ``mixed`` (prefill chunks beside decode rows) or ``decode`` (full or not)."""
    if batch.is_decode:
        return "decode, full batch" if len(batch.query_lens) == full else "decode, below the batch"
    return "mixed" if any(n == 1 for n in batch.query_lens) else "prefill"


def whole_run(llm, prompts, args, on_gpu: bool) -> None:
    """Time every step of one ``generate`` on the device's timeline and group the steps (``--whole-run``)."""
    from vllm_port import SamplingParams

    runner = llm.runner
    launch, steps = runner.launch, []

    def timed(batch, *a, **k):
        before = dict(runner.steps_by_kind)
        begun = None
        if on_gpu:  # reached when the device is done with what came before: after any idle, waiting for this launch
            begun = torch.cuda.Event(enable_timing=True)
            begun.record()
        entered = time.perf_counter()
        pending = launch(batch, *a, **k)
        after = runner.steps_by_kind
        kind = next((k for k in after if after[k] != before.get(k, 0)), "none")
        event = None
        if on_gpu:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        steps.append(
            {
                "group": step_group(batch, args.batch),
                "kind": "replayed" if "replayed" in kind else kind,
                "tokens": len(batch.input_ids),
                "rows": len(batch.query_lens),
                "host_ms": (time.perf_counter() - entered) * 1e3,
                "event": event,
                "begun": begun,
                "entered": entered,
            }
        )
        return pending

    runner.launch = timed
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    if on_gpu:
        torch.cuda.synchronize()
        start_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if on_gpu:
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    runner.launch = launch
    llm.close()
    previous = start_event if on_gpu else None
    for i, s in enumerate(steps):  # the step's share of the timeline: from the last step's end to its own
        event, begun = s.pop("event"), s.pop("begun")
        if on_gpu:
            s["device_ms"] = previous.elapsed_time(event)
            # the device idle between the last step's work and this launch's start (0 when it was queued behind it)
            s["idle_before_ms"] = max(previous.elapsed_time(begun), 0.0)
            previous = event
        else:  # no device events: from this launch to the next
            s["device_ms"] = ((steps[i + 1]["entered"] if i + 1 < len(steps) else start + wall_s) - s["entered"]) * 1e3
            s["idle_before_ms"] = 0.0
    groups: dict[tuple[str, str], dict[str, float]] = {}
    for s in steps:
        g = groups.setdefault(
            (s["group"], s["kind"]), {"steps": 0, "tokens": 0, "device_ms": 0.0, "host_ms": 0.0, "idle_before_ms": 0.0}
        )
        g["steps"] += 1
        g["tokens"] += s["tokens"]
        g["device_ms"] += s["device_ms"]
        g["host_ms"] += s["host_ms"]
        g["idle_before_ms"] += s["idle_before_ms"]
    on_steps_s = sum(s["device_ms"] for s in steps) / 1e3
    first_launch_s = steps[0]["entered"] - start if steps else 0.0
    print(
        f"{len(prompts)} requests x {args.prompt}/{args.output} tokens, KV cache {args.kv_cache_dtype}"
        f"{', mixed steps unsplit' if args.no_split else ''}: "
        f"generate {wall_s:.3f} s, {len(steps)} steps on the timeline {on_steps_s:.3f} s, "
        f"host before the first launch {first_launch_s * 1e3:.1f} ms"
    )
    print(
        "| steps | kind | count | tokens | timeline (ms) | ms a step | of it idle before the step (ms) | host launch (ms a step) |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (group, kind), g in sorted(groups.items(), key=lambda kv: -kv[1]["device_ms"]):
        n = g["steps"]
        print(
            f"| {group} | {kind} | {n} | {g['tokens']} | {g['device_ms']:.1f} | {g['device_ms'] / n:.2f} "
            f"| {g['idle_before_ms']:.1f} | {g['host_ms'] / n:.2f} |"
        )
    full = [s["device_ms"] for s in steps if s["group"] == "decode, full batch"]
    if full:
        ordered = sorted(full)
        steady = ordered[len(ordered) // 2]
        print(
            f"decode at the full batch: median {steady:.2f} ms a step; {len(full)} steps at the median would take "
            f"{steady * len(full) / 1e3:.3f} s, they took {sum(full) / 1e3:.3f} s"
        )
        print("  first 8 full-batch steps (ms):", " ".join(f"{x:.1f}" for x in full[:8]))
        print("  last 8 (ms):", " ".join(f"{x:.1f}" for x in full[-8:]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "wall_s": wall_s,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "groups": [{"group": k[0], "kind": k[1], **v} for k, v in groups.items()],
                    "steps": [{k: v for k, v in s.items() if k != "entered"} for s in steps],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
