"""Time the CPU plugin's native decode attention alone: one call at ``bench engine``'s decode shape, many rounds.

    [HEAD_MAJOR=1] .venv/bin/python dev/experiments/time_cpu_decode_attention.py [--threads 1] [--heads 12] \
        [--layers 8] [--rounds 20] [--block-size 16]

``bench_cpu_attention.py``'s caches (64 sequences of contexts 128..256, blocks scattered, ``HEAD_MAJOR=1`` laid
out as the CPU platform's engine lays them), bfloat16, 4 KV heads of 64, rotating over ``--layers`` layers'
caches (8: 100 MB, out of the L3 cache; 1: 12.6 MB, left in it, which times the arithmetic). With one thread
the clock is this thread's CPU time, else wall time. Checked against the reference first unless ``NO_CHECK=1``.
Prints the median and best milliseconds a call and the K/V bytes a second. To compare two builds of the
kernel, run this after each in alternation (the library is rebuilt when ``paged_attention.c`` changes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import bench_cpu_attention as cases
import torch

from vllm_port.ops import paged_attention as paged_op
from vllm_port_cpu import native


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12, help="query heads over 4 KV heads (12: the 768 model)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    cases.HEADS, cases.KV_HEADS, cases.BLOCK_SIZE, cases.LAYERS = args.heads, 4, args.block_size, args.layers
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(128, 257, (64,), generator=gen).tolist()
    layers, tables, seq_lens = cases.caches(lens, torch.bfloat16, gen)
    q = torch.randn(64, args.heads, cases.HEAD_SIZE, generator=gen).to(torch.bfloat16)
    calls = [(q, k, v, tables, seq_lens, cases.HEAD_SIZE**-0.5) for k, v in layers]
    fn = native.paged_attention.fn
    if not os.environ.get("NO_CHECK"):
        assert paged_op.check(fn, calls[0], torch.bfloat16) is None, "the native kernel disagrees with the reference"
    for call in calls:
        fn(*call)
    times = []
    for _ in range(args.rounds):
        start = clock()
        for call in calls:
            fn(*call)
        times.append((clock() - start) / len(calls))
    kv_bytes = sum(lens) * cases.KV_HEADS * cases.HEAD_SIZE * 2 * 2
    median = statistics.median(times)
    print(
        f"{args.heads}:4 heads, {args.threads} thread(s), block {args.block_size}, head-major "
        f"{os.environ.get('HEAD_MAJOR') == '1'}, {args.layers} layer(s): median {median * 1e3:.3f} ms, best "
        f"{min(times) * 1e3:.3f} ms, {kv_bytes / median / 1e9:.1f} GB/s of K/V; load {cases.load()}"
    )


if __name__ == "__main__":
    main()
