"""Host cost of an eager launch of every op the CUDA plugin binds (issue 30's goal: <= 25 us a call).

    python3 dev/experiments/probe_launch_cost.py [--dtype bfloat16] [--json FILE]

For each op: the bound provider's first small sample that is not marked ``large`` (the op's hand samples,
the shapes of a decode step), called 300 times without waiting for the device; the host's wall time per
call is its launch cost (the device finishes each small kernel well before the next launch arrives, so the
host is what is timed: the GPU time per call is printed beside it). Beside each op, the floor: an empty
Triton kernel launched with the same number of tensor arguments (through Triton's binder, and through the
cached launch of ``vllm_port.kernels.triton.launch``), and one ``torch.add`` (a cuBLAS-free ATen launch).
Each op is timed with the cached launch and with every launch through Triton's binder, in alternation
(``ROUNDS`` each, medians); "through binder" counts the launches per call that still went through Triton's
binder with the cache on (0 when every kernel of the provider launched from it). A ``cProfile`` of the
worst providers' calls names where their time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from vllm_port.kernels.triton import launch
from vllm_port.kernels.triton.launch import CachedLaunch, cached_launch
from vllm_port.runtime import load

CALLS = 300
#: alternations of Triton's binder and the cached launch per op (the median of each is reported)
ROUNDS = 5
#: the costliest providers profiled
PROFILED = 8


@triton.jit
def _empty(a, b, c, d, e, f, g, h, n: tl.constexpr):  # the arguments are what is launched
    pass


_empty_cached = cached_launch(_empty)


def through_triton() -> int:
    """Launches so far that went through Triton's binder, over every cached-launch kernel loaded."""
    kernels = {id(v): v for m in list(sys.modules.values()) if m and m.__name__.startswith("vllm_port")
               for v in vars(m).values() if isinstance(v, CachedLaunch)}  # fmt: skip
    return sum(k.through_triton for k in kernels.values())


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


def ab_us(fn, args) -> tuple[float, float]:
    """Median host us a call through Triton's binder and through the cached launch, measured in alternation."""
    cached_on, binder, cached = launch._on, [], []
    try:
        for _ in range(ROUNDS):
            launch._on = lambda: False
            binder.append(host_us(fn, args))
            launch._on = cached_on
            cached.append(host_us(fn, args))
    finally:
        launch._on = cached_on
    return statistics.median(binder), statistics.median(cached)


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
    empty = [
        host_us(lambda *t, k=k: k[(1,)](*t, n=1), (x,) * 8) for _ in range(ROUNDS) for k in (_empty, _empty_cached)
    ]
    # the cached launch's pieces: its C launcher called with the tensors (Triton's launcher then calls data_ptr() and
    # cuPointerGetAttribute for each), with their addresses (what the cached launch passes), and the key alone
    launcher, head, rest = next(iter(_empty_cached._compiled.values()))
    stream = torch.cuda.current_stream().cuda_stream
    addresses = (x.data_ptr(),) * 8
    pieces = [
        host_us(lambda *t: launcher(1, 1, 1, stream, *head, *t, *rest), given)
        for _ in range(ROUNDS)
        for given in ((x,) * 8, addresses)
    ]
    floor = {
        "empty Triton kernel, 8 tensors": statistics.median(empty[0::2]),
        "the same, cached launch": statistics.median(empty[1::2]),
        "its C launcher, 8 tensors": statistics.median(pieces[0::2]),
        "its C launcher, 8 addresses": statistics.median(pieces[1::2]),
        "the cached launch's key of 8 tensors": host_us(launch._keyed, ((x,) * 8, {"n": 1})),
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
            fn(*sample.args)  # the first launches compile and key each kernel
            before = through_triton()
            host = host_us(fn, sample.args)
            slow = (through_triton() - before) / (CALLS + 20)  # launches through Triton's binder per call
            binder, host = ab_us(fn, sample.args)
            gpu = device_us(fn, sample.args)
        except Exception as exc:
            print(f"{name:34s} {provider.name:40s} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        row = {"op": name, "provider": provider.name, "plugin": provider.plugin, "sample": sample.label,
               "host_us": host, "binder_host_us": binder, "device_us": gpu,
               "through_triton_per_call": slow}  # fmt: skip
        rows.append(row)
        print(f"{name:34s} {provider.name:40s} host {host:7.1f} us (binder {binder:7.1f})  device {gpu:8.1f} us  "
              f"through binder {slow:4.1f}/call  ({sample.label})", flush=True)  # fmt: skip
    for row in sorted(rows, key=lambda r: -r["host_us"])[:PROFILED]:
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
