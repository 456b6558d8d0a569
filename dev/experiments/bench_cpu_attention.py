"""Time the CPU plugin's attention providers: the native kernel against the torch one, at the engine's shapes.

    .venv/bin/python dev/experiments/bench_cpu_attention.py [--threads 2] [--repeat 5] [--cpu-time] \
        [--heads 8 --kv-heads 4] [--dtypes bfloat16,float32]

Decode: ``bench engine``'s model and workload (64 sequences, 8 heads over 4 KV heads unless told, head 64,
block 16, contexts drawn from 128..256, as the decode steps of 128 prompt + 128 output tokens see
them). Prefill: 16 sequences of 128 new tokens (one 2,048-token chunk of the engine's default
``max_num_batched_tokens``), and a chunked prefill of 64 new tokens after a 192-token cached prefix.
Each call rotates over 8 layers' caches, as a step does, so K/V come from memory, not from a cache
left warm by the previous call. Prints the median time per call of each provider, the speedup,
and the load average before and after (the machine is shared: compare only rows of one run).
``NO_CHECK=1`` skips the check against the reference first (for variants that leave work out on purpose).
``HEAD_MAJOR=1`` stores the caches head before token, as the CPU platform's engine does (``kv_head_major``);
unset or ``0``, token before head, the contract's shape as stored.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from vllm_port.ops import paged_attention as paged_op
from vllm_port.ops import prefill_attention as prefill_op
from vllm_port_cpu import attention, native

LAYERS = 8
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 4, 64, 16


def load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def caches(seq_lens: list[int], dtype: torch.dtype, gen: torch.Generator):
    """Per layer: key and value caches with every sequence's blocks scattered, and the shared block tables."""
    need = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(need)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[used : used + n]
        used += n
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    # HEAD_MAJOR=1: each KV head's rows of a block side by side in memory, the same logical cache
    if os.environ.get("HEAD_MAJOR") == "1":
        stored = (num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        layers = [
            tuple(torch.randn(stored, generator=gen).to(dtype).permute(0, 2, 1, 3) for _ in range(2))
            for _ in range(LAYERS)
        ]
        return layers, tables, torch.tensor(seq_lens, dtype=torch.int32)
    layers = [
        (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
        for _ in range(LAYERS)
    ]
    return layers, tables, torch.tensor(seq_lens, dtype=torch.int32)


#: The clock: wall time, or with one thread this thread's CPU time (time away from the CPU, on a shared
#: machine, is not counted; memory contention still is).
CLOCK = time.perf_counter


def timed(fn, calls: list[tuple], repeat: int) -> float:
    """Median seconds per call over ``repeat`` passes through ``calls`` (one per layer), after a warm-up pass."""
    for args in calls:
        fn(*args)
    times = []
    for _ in range(repeat):
        start = CLOCK()
        for args in calls:
            fn(*args)
        times.append((CLOCK() - start) / len(calls))
    return statistics.median(times)


def compare(label: str, op, torch_fn, native_fn, calls: list[tuple], dtype: torch.dtype, repeat: int) -> None:
    assert os.environ.get("NO_CHECK") or op.check(native_fn, calls[0], dtype) is None, (
        f"{label}: the native kernel disagrees with the reference"
    )
    before = load()
    t_torch = timed(torch_fn, calls, repeat)
    t_native = timed(native_fn, calls, repeat)
    print(
        f"{label:<44} {str(dtype).removeprefix('torch.'):<9} torch {t_torch * 1e3:8.3f} ms   native "
        f"{t_native * 1e3:8.3f} ms   {t_torch / t_native:5.2f}x   load {before} -> {load()}"
    )


def main() -> None:
    global HEADS, KV_HEADS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cpu-time", action="store_true", help="with --threads 1: time this thread's CPU time")
    parser.add_argument("--heads", type=int, default=HEADS, help="query heads (12 with --kv-heads 4: the 768 model)")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    HEADS, KV_HEADS = args.heads, args.kv_heads
    torch.set_num_threads(args.threads)
    if args.cpu_time:
        if args.threads != 1:
            raise SystemExit("--cpu-time measures one thread: pass --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.status}")
    clock = "thread CPU time" if args.cpu_time else "wall time"
    print(f"torch threads {torch.get_num_threads()}, {clock}; {HEADS}:{KV_HEADS} heads; native: {native.status}")
    gen = torch.Generator().manual_seed(0)
    scale = HEAD_SIZE**-0.5
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        lens = torch.randint(128, 257, (64,), generator=gen).tolist()
        layers, tables, seq_lens = caches(lens, dtype, gen)
        q = torch.randn(64, HEADS, HEAD_SIZE, generator=gen).to(dtype)
        calls = [(q, k, v, tables, seq_lens, scale) for k, v in layers]
        compare("decode: 64 seqs, context 128..256", paged_op, attention.paged_attention.fn,
                native.paged_attention.fn, calls, dtype, args.repeat * 4)  # fmt: skip
        for label, q_len, prefix, seqs in (
            ("prefill: 16 seqs x 128 new tokens", 128, 0, 16),
            ("chunked prefill: 16 seqs x 64 after 192", 64, 192, 16),
        ):
            layers, tables, seq_lens = caches([prefix + q_len] * seqs, dtype, gen)
            q = torch.randn(seqs * q_len, HEADS, HEAD_SIZE, generator=gen).to(dtype)
            cu = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32)
            calls = [(q, k, v, tables, cu, seq_lens, q_len, scale) for k, v in layers]
            compare(label, prefill_op, attention.prefill_attention.fn, native.prefill_attention.fn,
                    calls, dtype, args.repeat)  # fmt: skip


if __name__ == "__main__":
    main()
