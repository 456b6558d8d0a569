"""``vllm-port bench fp8-linear``: the Triton ``fp8_linear`` beside ``torch._scaled_mm`` (cuBLASLt) and bf16 matmul.

Shapes: Llama-3-8B's projections (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096)
and Qwen3-30B-A3B's attention (qkv 2048 -> 5120, o 4096 -> 2048), at M = 1, 16, 256 and 4096 tokens by default.
Each is timed with ``triton.testing.do_bench``, which clears the L2 before every call (a decode step meets
each weight once). Columns:

- ``triton``: the bound ``fp8_linear`` (the CUDA plugin's Triton kernel), the whole op as the engine calls it (per-token quantisation of x, then the FP8 matmul) with a
  per-channel weight scale; ``triton group``: the same with 128-feature groups (block-wise checkpoints);
- ``scaled_mm``: ``torch._scaled_mm`` on x already quantised (row-wise scales: per token x per channel), so the
  library's matmul alone; ``scaled_mm+quant``: with torch's own per-token quantisation before it;
- ``bf16``: ``torch.matmul`` on bfloat16 operands.

Per cell: microseconds, GB/s of the e4m3 weight's bytes (bf16: of its own bytes), TFLOP/s (2 M N K), and the
copy bandwidth of the device for scale. On a device without FP8 (or CPU) the library columns say why they
are missing. Runs only where Triton compiles for the device (a GPU).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from ..ops.fp8 import quantize_fp8_rows, quantize_fp8_weight

__all__ = ["ROWS", "SHAPES", "main"]

#: name -> (in_features, out_features)
SHAPES: dict[str, tuple[int, int]] = {
    "llama3-8b qkv": (4096, 6144),
    "llama3-8b o": (4096, 4096),
    "llama3-8b gate_up": (4096, 28672),
    "llama3-8b down": (14336, 4096),
    "qwen3-30b-a3b qkv": (2048, 5120),
    "qwen3-30b-a3b o": (4096, 2048),
}
ROWS = (1, 16, 256, 4096)


def _time_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _weights(k: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """One shape's weight: e4m3 per channel, e4m3 per group, bfloat16 (made on the device: 117M elements take
    seconds on the host)."""
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    return (*quantize_fp8_weight(w, "channel"), *quantize_fp8_weight(w, "group"), w.to(torch.bfloat16))


def _cases(x: torch.Tensor, weights: tuple[torch.Tensor, ...], kernels: Any) -> dict[str, Callable[[], Any] | str]:
    """Each column's call on one shape, or why it cannot run here."""
    wq, ws, gq, gs, wb = weights
    cases: dict[str, Callable[[], Any] | str] = {
        "triton": lambda: kernels.fp8_linear(x, wq, ws),
        "triton group": lambda: kernels.fp8_linear(x, gq, gs),
        "bf16": lambda: torch.matmul(x, wb.t()),
    }
    xq, xs = quantize_fp8_rows(x)
    col = ws[None, :].contiguous()

    def scaled(a: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=col, out_dtype=torch.bfloat16)

    try:
        scaled(xq, xs)
        cases["scaled_mm"] = lambda: scaled(xq, xs)
        cases["scaled_mm+quant"] = lambda: scaled(*quantize_fp8_rows(x))
    except (RuntimeError, NotImplementedError) as exc:  # no FP8 GEMM here, or a shape cuBLASLt refuses
        cases["scaled_mm"] = cases["scaled_mm+quant"] = f"n/a: {str(exc).splitlines()[0][:120]}"
    return cases


def main(
    json_path: str | None = None,
    rows: tuple[int, ...] = ROWS,
    shapes: tuple[str, ...] = tuple(SHAPES),
    device: str | None = None,
) -> int:
    """Time every column at every shape and row count on the selected platform; print a table per shape; write JSON when asked."""
    from .. import load
    from ._timing import copy_bandwidth_gbs

    runtime = load(device=device)  # discovery picks the platform; --device names one
    dev = runtime.device
    if dev.type == "cpu":
        print("bench fp8-linear: the selected platform runs on the CPU; this benchmark times a device's kernels "
              "(install a GPU plugin, or name its device with --device)")  # fmt: skip
        return 2
    kernels = runtime.bind(torch.bfloat16)  # what the platform binds: its kernel, its target's tiles
    provider = kernels.providers["fp8_linear"]
    probe = runtime.selected.probe
    device_name = probe.devices[0].name if probe and probe.devices else runtime.platform.name
    copy = copy_bandwidth_gbs(dev, 1 << 30)
    print(f"{device_name} ({runtime.platform.name}), fp8_linear bound to {provider.name} ({provider.plugin}); "
          f"copy bandwidth {copy:,.0f} GB/s; do_bench medians, L2 cleared per call")  # fmt: skip
    results: list[dict[str, Any]] = []
    for name in shapes:
        k, n = SHAPES[name]
        print(f"\n{name}: {k} -> {n} (e4m3 weight {k * n / 1e6:.1f} MB)")
        print("| M | column | us | weight GB/s | % of copy | TFLOP/s | vs scaled_mm |")
        print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
        weights = _weights(k, n, dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            cases = _cases(x, weights, kernels)
            times = {col: _time_us(fn) for col, fn in cases.items() if callable(fn)}
            for col, fn in cases.items():
                if not callable(fn):
                    print(f"| {m} | {col} | {fn} | | | | |")
                    results.append({"shape": name, "rows": m, "column": col, "missing": fn})
                    continue
                us = times[col]
                weight_bytes = k * n * (2 if col == "bf16" else 1)
                gbs, tflops = weight_bytes / us / 1e3, 2 * m * n * k / us / 1e6
                ratio = times["scaled_mm"] / us if "scaled_mm" in times else float("nan")
                print(
                    f"| {m} | {col} | {us:,.1f} | {gbs:,.0f} | {100 * gbs / copy:.0f}% | {tflops:,.1f} | {ratio:.2f}x |"
                )
                results.append({"shape": name, "in": k, "out": n, "rows": m, "column": col, "us": us,
                                "weight_gbs": gbs, "tflops": tflops, "vs_scaled_mm": ratio})  # fmt: skip
    ratios = [
        r["vs_scaled_mm"]
        for r in results
        if r.get("column") == "triton" and r.get("vs_scaled_mm") == r.get("vs_scaled_mm")
    ]
    if ratios:
        print(f"\ntriton vs scaled_mm: median {statistics.median(ratios):.2f}x over {len(ratios)} cells")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {"device": device_name, "platform": runtime.platform.name, "copy_gbs": copy, "results": results},
                f,
                indent=1,
            )
    return 0
