"""What the sampling features cost a decode step: ``python core/tests/engine/bench_sampling_step.py [ROUNDS]`` (a benchmark).

``ModelRunner.execute`` on 16 recorded decode batches of the bundled model (16 sampled requests),
round-robin over the variants after two warm-up rounds: the plain batches, the same batches with
penalties and min_p on every row, and with logprobs=5 on every row. Run it with
``PYTHONPATH=<main checkout>/core/src:<main checkout>/plugins/vllm-port-cpu/src`` to time the step
before these features (only the plain variant exists there).
"""

import copy
import statistics
import sys
import time

import torch

from vllm_port import LLM, SamplingParams

torch.set_num_threads(1)
llm = LLM(kv_cache_memory=64 << 20)
recorded = []
real = llm.runner.execute


def record(batch):
    recorded.append(copy.deepcopy(batch))
    return real(batch)


llm.runner.execute = record
prompts = [f"It is a truth universally acknowledged {i}" for i in range(16)]
llm.generate(prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True))
llm.runner.execute = real
decode = [b for b in recorded if b.is_decode and len(b.query_lens) == 16][:16]


def variants():
    yield "plain", decode
    if hasattr(decode[0], "processing"):
        from vllm_port.engine.scheduler import RowProcessing

        proc = []
        for b in decode:
            b2 = copy.deepcopy(b)
            b2.processing = {
                i: RowProcessing(1.2, 0.3, 0.2, 0.05, {}, None, (), tuple(range(40)), tuple(range(20)))
                for i in range(len(b.sample_rows))
            }
            proc.append(b2)
        yield "penalties+min_p, every row", proc
        lp = []
        for b in decode:
            b2 = copy.deepcopy(b)
            b2.logprobs = {i: 5 for i in range(len(b.sample_rows))}
            lp.append(b2)
        yield "logprobs=5, every row", lp


all_variants = list(variants())
times = {name: [] for name, _ in all_variants}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
for r in range(rounds + 2):  # round-robin over the variants; the first two rounds warm up
    for name, batches in all_variants:
        for b in batches:
            t = time.perf_counter()
            llm.runner.execute(b)
            dt = time.perf_counter() - t
            if r >= 2:
                times[name].append(dt)
for name, ts in times.items():
    print(
        f"{name}: min {min(ts) * 1e3:.3f} ms, p10 {statistics.quantiles(ts, n=10)[0] * 1e3:.3f} ms, median {statistics.median(ts) * 1e3:.3f} ms over {len(ts)} steps"
    )
