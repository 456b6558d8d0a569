"""Timing helpers shared by the benchmarks: device-agnostic (torch.accelerator), median of many runs."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ..graph_capture import GraphCapture


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def median_ms(
    fn: Callable[[], Any], device: torch.device, warmup: int = 3, repeat: int = 20, min_time_s: float = 0.05
) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    On an accelerator each sample is a batch of calls timed with device events (launches overlap
    as in a real step); on CPU, with the wall clock. Batches grow until one takes ``min_time_s``.
    """
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    synchronize(device)
    if time.perf_counter() - start > 0.5 * warmup:  # a slow peer (a Python-loop reference): a few samples do
        repeat = 3
    batch = 1
    while True:
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        synchronize(device)
        if time.perf_counter() - start >= min_time_s / repeat or batch >= 1 << 14:
            break
        batch *= 2
    samples = []
    for _ in range(repeat):
        if device.type == "cpu":
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            samples.append((time.perf_counter() - start) * 1e3 / batch)
        else:
            begin, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
            begin.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / batch)
    return statistics.median(samples)


def graph_median_ms(
    fn: Callable[[], Any], capture: GraphCapture, device: torch.device, calls: int = 20, repeat: int = 10
) -> float:
    """Median device time of one call of ``fn``: ``calls`` calls captured in one graph, the replays timed.

    This measures what the device does, without the host's launch overhead (which a runner also
    removes by replaying graphs); ``fn`` must not synchronise with the host.
    """
    replay = capture.capture(lambda: [fn() for _ in range(calls)])
    return median_ms(replay, device, warmup=2, repeat=repeat) / calls


#: Bytes written between two cold-cache samples: several times the last-level cache of current
#: accelerators (50 MiB on an H100/H200, 256 MiB of Infinity Cache on an MI300X).
FLUSH_BYTES = 512 << 20


def cold_median_ms(fn: Callable[[], Any], device: torch.device, repeat: int = 25, warmup: int = 3) -> float:
    """Median time of one call of ``fn`` with the caches flushed before each call (as triton's ``do_bench``).

    Each sample writes :data:`FLUSH_BYTES` (64 MiB on CPU) first, so ``fn`` reads its inputs from
    memory, not from a cache the previous call warmed; on an accelerator the call alone is timed
    with device events, on CPU with the wall clock.
    """
    flush = torch.empty(FLUSH_BYTES // 4 if device.type != "cpu" else (64 << 20) // 4, device=device)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        flush.zero_()
        if device.type == "cpu":
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
            continue
        begin, end = torch.Event(device=device, enable_timing=True), torch.Event(device=device, enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end))
    return statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() * 4 / ms / 1e6


def read_bandwidth_gbs(device: torch.device, nbytes: int) -> float:
    """Read-only stream bandwidth in GB/s: a sum over ``nbytes`` of float32, which writes next to nothing.

    A copy pays for turning the bus around between reads and writes; a kernel that mostly reads
    (decode attention, a norm's weight-free reduction) can go past the copy rate, so memory-bound
    rows are judged against both.
    """
    src = torch.randn(nbytes // 4, device=device)
    out = torch.empty((), device=device)
    ms = median_ms(lambda: torch.sum(src, dim=0, out=out), device)
    return src.numel() * 4 / ms / 1e6


def matmul_tflops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """Dense matrix-product rate in TFLOP/s on random ``n x n`` operands."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, device)
    return 2 * n**3 / ms / 1e9


def load_average() -> float | None:
    """The host's 1-minute load average (other processes share a CPU platform's cores), where the OS gives one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
