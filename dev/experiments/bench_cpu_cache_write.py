"""reshape_and_cache per call: the CPU plugin's native provider beside its torch provider, alternating, min of repeats.

    .venv/bin/python dev/experiments/bench_cpu_cache_write.py [THREADS]

bfloat16 rows into a 2,048-block cache of 16 slots, slots at random; results in docs/results/cpu-elementwise.md.
"""

import sys
import timeit

import torch

from vllm_port_cpu import attention, native

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)


def args(tokens, heads, hd, dtype, blocks=2048, bs=16):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, heads, hd, generator=g).to(dtype)
    v = torch.randn(tokens, heads, hd, generator=g).to(dtype)
    kc = torch.zeros(blocks, bs, heads, hd, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens].to(torch.int64)
    return k, v, kc, vc, slots


for label, shape in [
    ("decode 64 seqs, 4 kv heads x 64", (64, 4, 64)),
    ("decode 64 seqs, 8 kv heads x 128", (64, 8, 128)),
    ("prefill 2048 tokens, 4 x 64", (2048, 4, 64)),
    ("prefill 2048 tokens, 8 x 128", (2048, 8, 128)),
]:
    a = args(*shape, torch.bfloat16)
    res = {}
    for _ in range(3):
        for name, fn in (("torch", attention.reshape_and_cache.fn), ("native", native.reshape_and_cache.fn)):
            n = 200 if shape[0] < 1000 else 50
            t = min(timeit.repeat(lambda fn=fn, a=a: fn(*a), number=n, repeat=5)) / n * 1e6
            res[name] = min(res.get(name, 1e9), t)
    print(
        f"{label:34s} torch {res['torch']:8.1f} us  native {res['native']:8.1f} us  {res['torch'] / res['native']:5.1f}x",
        flush=True,
    )
