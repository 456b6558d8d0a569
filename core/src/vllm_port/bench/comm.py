"""All-reduce through the comm contract against calling ``torch.distributed`` directly.

Two ranks are spawned on the selected platform's backend and device (gloo on CPU, nccl on two
CUDA GPUs); for each message size (8 B .. 64 MB of float32) both ways are timed in the same run,
interleaved round by round so drift hits both alike. Reported per size: the median time per call
on rank 0, bus bandwidth (``algbw * 2 (n-1) / n``, the NCCL-tests convention) and the contract's
overhead in microseconds and percent.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import vllm_port
from vllm_port.comm import DistContext
from vllm_port.spawn import run_ranks

from ._timing import synchronize

SIZES = (8, 64, 512, 4096, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
WORLD_SIZE = 2
ROUNDS = 15


def _time_calls(fn: Any, device: torch.device, n: int) -> float:
    dist.barrier()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / n


def _rank_main(ctx: DistContext, plugins: str | None, device_name: str, sizes: tuple[int, ...], budget_s: float) -> Any:
    comm = vllm_port.load(plugins=plugins, device=device_name).communicator()
    rows = []
    for size in sizes:
        t = torch.ones(max(size // 4, 1), dtype=torch.float32, device=ctx.device)
        ways = {"torch.distributed": lambda t=t: dist.all_reduce(t), "contract": lambda t=t: comm.all_reduce(t)}
        for fn in ways.values():  # warm up, and size the batches
            fn()
        one = _time_calls(ways["torch.distributed"], ctx.device, 3)
        # the batch size must agree across ranks: take rank 0's
        n_t = torch.tensor([max(1, min(500, int(budget_s / (2 * ROUNDS) / max(one, 1e-7))))], device=ctx.device)
        dist.broadcast(n_t, 0)
        n = int(n_t.item())
        samples: dict[str, list[float]] = {k: [] for k in ways}
        order = list(ways)
        for _ in range(ROUNDS):
            for k in order:
                samples[k].append(_time_calls(ways[k], ctx.device, n))
            order.reverse()  # ABBA: neither way always goes first
        direct, contract = (statistics.median(samples[k]) for k in ("torch.distributed", "contract"))
        bus = 2 * (ctx.world_size - 1) / ctx.world_size

        def gbps(s: float, size: int = size, bus: float = bus) -> float:
            return size / s * bus / 1e9

        rows.append(
            {
                "bytes": size,
                "calls_per_sample": n,
                "direct_us": direct * 1e6,
                "contract_us": contract * 1e6,
                "overhead_us": (contract - direct) * 1e6,
                "overhead_pct": (contract - direct) / direct * 100,
                "direct_busbw_GBps": gbps(direct),
                "contract_busbw_GBps": gbps(contract),
            }
        )
    return rows


def _call_cost(ctx: DistContext, plugins: str | None, device_name: str) -> dict[str, float]:
    """The contract's own cost per all_reduce call, on a one-rank group (no peer, no network noise)."""
    comm = vllm_port.load(plugins=plugins, device=device_name).communicator()
    t = torch.ones(2, device=ctx.device)
    ways = {"direct_us": lambda: dist.all_reduce(t), "contract_us": lambda: comm.all_reduce(t)}
    best = {k: min(_time_calls(fn, ctx.device, 2000) for _ in range(7)) * 1e6 for k, fn in ways.items()}
    best["overhead_us"] = best["contract_us"] - best["direct_us"]
    return best


def measure(device: str | None = None, plugins: str | None = None, max_bytes: int = 64 << 20) -> dict[str, Any]:
    runtime = vllm_port.load(plugins=plugins, device=device)
    probe = runtime.selected.probe
    sizes = tuple(s for s in SIZES if s <= max_bytes)
    rows = run_ranks(
        _rank_main,
        runtime.platform,
        WORLD_SIZE,
        args=(plugins, runtime.platform.name, sizes, 2.0),
        timeout_s=120,
        deadline_s=540,
        device_count=probe.device_count if probe else None,
    )[0]
    one_rank = run_ranks(_call_cost, runtime.platform, 1, args=(plugins, runtime.platform.name), timeout_s=60)[0]
    return {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "platform": runtime.platform.name,
        "backend": runtime.platform.dist_backend,
        "world_size": WORLD_SIZE,
        "dtype": "float32",
        "timing": f"median of {ROUNDS} ABBA-interleaved samples per way, each a batch of calls after a barrier; "
        "rank 0's clock",
        "call_cost_one_rank": one_rank,
        "served_by": runtime.communicator().served_by_call["all_reduce"],
        "rows": rows,
    }


def _human(n: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}"
    return f"{n} B"


def render(result: dict[str, Any]) -> str:
    lines = [
        f"all_reduce on {result['world_size']} ranks, {result['backend']} ({result['platform']}), "
        f"{result['dtype']}, torch {result['torch']}",
        f"{'size':>8}{'direct us':>12}{'contract us':>13}{'added us':>10}{'added %':>9}{'busbw GB/s':>12}",
    ]
    c = result["call_cost_one_rank"]
    lines.insert(
        1,
        f"contract cost per call on a 1-rank group (best of 7 x 2000 calls): {c['contract_us']:.2f} us vs "
        f"{c['direct_us']:.2f} us direct, {c['overhead_us']:+.2f} us",
    )
    for r in result["rows"]:
        lines.append(
            f"{_human(r['bytes']):>8}{r['direct_us']:>12.1f}{r['contract_us']:>13.1f}{r['overhead_us']:>10.1f}"
            f"{r['overhead_pct']:>8.1f}%{r['direct_busbw_GBps']:>12.3f}"
        )
    return "\n".join(lines)


def main(json_path: str | None = None, device: str | None = None, max_bytes: int = 64 << 20) -> int:
    result = measure(device=device, max_bytes=max_bytes)
    print(render(result))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
