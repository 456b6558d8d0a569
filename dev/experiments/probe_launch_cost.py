"""Host cost of an eager launch of every op the CUDA plugin binds (issue 30's goal: <= 25 us a call).

    python3 dev/experiments/probe_launch_cost.py [--dtype bfloat16] [--json FILE]

For each op: the bound provider's first small sample that is not marked ``large`` (the op's hand samples,
the shapes of a decode step), called 300 times without waiting for the device; the host's wall time per
call is its launch cost (the device finishes each small kernel well before the next launch arrives, so the
host is what is timed: the GPU time per call is printed beside it). Beside each op, the floor: an empty
Triton kernel launched with the same number of tensor arguments, and one ``torch.add`` (a cuBLAS-free
ATen launch). A ``cProfile`` of the worst providers' calls names where their time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import triton
import triton.language as tl

from vllm_port.runtime import load

CALLS = 300


@triton.jit
def _empty(a, b, c, d, e, f, g, h, n: tl.constexpr):  # the arguments are what is launched
    pass


def host_us(fn, args) -> float:
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(CALLS):
        fn(*args)
    host = (time.perf_counter() - begin) / CALLS * 1e6
    torch.cuda.synchronize()
    return host


def device_us(fn, args) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):
        fn(*args)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    runtime = load(device="cuda")
    bound = runtime.bind(dtype)
    device = torch.device("cuda")
    x = torch.zeros(8, device=device)
    floor = {
        "empty Triton kernel, 8 tensors": host_us(lambda *t: _empty[(1,)](*t, n=1), (x,) * 8),
        "torch.add": host_us(torch.add, (x, x)),
    }
    for label, us in floor.items():
        print(f"{'floor':34s} {label:40s} host {us:7.1f} us", flush=True)
    rows = []
    for name, op in sorted(runtime.registry.ops.items()):
        provider = bound.providers[name]
        gen = torch.Generator().manual_seed(0)
        try:
            samples = [s for s in op.samples(dtype, device, gen) if not s.large]
        except Exception as exc:  # an op without samples in this dtype
            print(f"{name:34s} no samples in {dtype}: {exc}", flush=True)
            continue
        if not samples:
            continue
        sample = samples[0]
        fn = getattr(bound, name)
        try:
            host = host_us(fn, sample.args)
            gpu = device_us(fn, sample.args)
        except Exception as exc:
            print(f"{name:34s} {provider.name:40s} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        row = {"op": name, "provider": provider.name, "plugin": provider.plugin, "sample": sample.label,
               "host_us": host, "device_us": gpu}  # fmt: skip
        rows.append(row)
        print(f"{name:34s} {provider.name:40s} host {host:7.1f} us  device {gpu:8.1f} us  ({sample.label})", flush=True)
    for row in sorted(rows, key=lambda r: -r["host_us"])[:4]:
        op = runtime.registry.ops[row["op"]]
        gen = torch.Generator().manual_seed(0)
        sample = next(s for s in op.samples(dtype, device, gen) if not s.large)
        fn = getattr(bound, row["op"])
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(100):
            fn(*sample.args)
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(10)
        print(f"== cProfile of 100 calls: {row['op']} ({row['provider']})")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "floor": floor, "ops": rows}, out)


if __name__ == "__main__":
    main()
