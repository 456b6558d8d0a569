"""vLLM's engine core around each ``generate``: its minor page faults and CPU times, with or without the bridge.

Run with vLLM's Python (``dev/setup-vllm-peer``; the bridge's venv from ``dev/vllm-bridge-venv`` and
``VLLM_PORT_CERTIFICATE`` for the bridged side), on a model directory and a JSON list of prompts' token ids:

    python probe_bridge_faults.py MODEL PROMPTS.json

It warms up, then runs two 64-token ``generate`` calls of every prompt (greedy, float32, 64 sequences a
step) and prints, per call, its wall time and the engine core's minor faults, user and system seconds
(``/proc/PID/stat``). With ``PIDFILE=F`` it writes the core's pid to ``F`` as the second call starts, for
``perf record -p`` to sample it. Result: ``docs/results/bridge-cpu.md``, "The engine core under perf".
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
from vllm import LLM, SamplingParams


def children_stats() -> dict[int, tuple[int, float, float]]:
    """Per child process of this one: minor faults, user and system seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for child in psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{child.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        stats[child.pid] = (int(fields[7]), int(fields[11]) / ticks, int(fields[12]) / ticks)
    return stats


def main(model: str, prompts_file: str) -> None:
    with open(prompts_file) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", max_model_len=512, max_num_seqs=64,
              enable_prefix_caching=False, seed=0)  # fmt: skip

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate(prompts, params(8), use_tqdm=False)  # warm-up
    for call in range(2):
        before = children_stats()
        if call == 1 and os.environ.get("PIDFILE"):
            with open(os.environ["PIDFILE"], "w") as f:
                f.write(" ".join(map(str, before)))
        start = time.perf_counter()
        llm.generate(prompts, params(64), use_tqdm=False)
        wall = time.perf_counter() - start
        after = children_stats()
        for pid, (faults, user, system) in after.items():
            if pid in before and faults - before[pid][0] > 1000:  # the engine core; idle helpers fault little
                f0, u0, s0 = before[pid]
                print(f"call {call}: generate 64: {wall:.3f} s; pid {pid}: {faults - f0} minor faults, "
                      f"user {user - u0:.2f} s, system {system - s0:.2f} s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:3])
