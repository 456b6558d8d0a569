"""A running engine's decode steps on the device's timeline: kernels' busy time against the steps' wall time.

    python3 dev/experiments/probe_engine_timeline.py MODEL_DIR [--batch 256] [--steps 20] [--json OUT]

``bench engine --h200``'s requests (``--batch`` of 512 random prompt tokens, 256 greedy output tokens) on
``MODEL_DIR`` with the engine's defaults. ``torch.profiler`` records ``--steps`` decode steps from the middle
of the decode phase, as the engine runs them (replayed graphs, a step ahead). Prints the window's wall time a
step, the device's busy time a step (the union of its kernels' and copies' intervals), the idle rest, and the
kernels that took the most time. Issue 30: at 256 sequences on an H100 the engine's step took 18.7 ms where
`vllm-port profile` replays the same step's graph in 14.7 ms.
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
    parser.add_argument("--json")
    args = parser.parse_args()
    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        max_model_len=args.prompt + args.output,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
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


if __name__ == "__main__":
    main()
