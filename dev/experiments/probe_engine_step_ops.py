"""Where a running engine's CPU decode step goes, op by op: each bound op wrapped in a wall-time counter.

    .venv/bin/python dev/experiments/probe_engine_step_ops.py MODEL_DIR [--threads 2]

``bench engine``'s workload (64 requests of 128 random prompt tokens, 128 greedy output tokens, bfloat16) on
``MODEL_DIR`` (``bench.engine_workload.build_model``'s model, saved). Only decode steps count. Prints each op's
milliseconds a step and the step's own time (``ModelRunner.launch``: forward, LM head, sampling). Unlike
``vllm-port profile``, which times a step's nodes on a prepared cache, this sees the caches as the engine
leaves them between ops (issue 30: the attention took 1.75 ms a call here and 0.63 ms in the profile).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from vllm_port import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=None, help="KV-cache block (default: the platform's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model_dir, dtype="bfloat16", block_size=args.block_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 32000, (128,), generator=gen).tolist()} for _ in range(64)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    runner, ops = llm.runner, llm.runner.ops
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    decoding = [False]

    def counted(name, fn):
        def timed(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            if decoding[0]:
                spent[name] += time.perf_counter() - start
                calls[name] += 1
            return out

        return timed

    for name in ops.providers:
        setattr(ops, name, counted(name, getattr(ops, name)))
    launch, steps = runner.launch, [0, 0.0]

    def timed_launch(batch, *a, **k):
        decoding[0] = batch.is_decode
        start = time.perf_counter()
        out = launch(batch, *a, **k)
        if batch.is_decode:
            steps[0] += 1
            steps[1] += time.perf_counter() - start
        return out

    runner.launch = timed_launch
    with open("/proc/loadavg") as f:
        print("load average", " ".join(f.read().split()[:3]))
    llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True))
    n = steps[0]
    print(f"decode steps {n}: {steps[1] / n * 1e3:.2f} ms a step in ModelRunner.launch")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<20} {seconds / n * 1e3:7.2f} ms a step, {calls[name] // n} calls")
    print(f"  ops in all         {sum(spent.values()) / n * 1e3:7.2f} ms a step")


if __name__ == "__main__":
    main()
