"""``vllm-port bench moe``: one MoE layer through the bound ``fused_moe`` beside ``torch._grouped_mm``.

One layer of a real model's shape (``--shape``, Qwen3-30B-A3B by default: hidden 2048, 128 experts
of intermediate 768, top-8) with random weights on the device, at each token count. Every
implementation runs the whole layer from router logits to output, with the contract's routing
(:func:`vllm_port.ops.moe.route`) so that they choose the same experts:

- ``fused_moe``: the provider the platform binds (the Triton kernels on a GPU);
- ``grouped_mm``: torch's grouped GEMM (cuBLAS/CUTLASS): pairs sorted by expert, ``torch._grouped_mm``
  through the gate/up rows, ``silu * up``, ``torch._grouped_mm`` through the down rows, weighted
  ``index_add_`` (where this torch and device have it: Hopper and newer);
- ``grouped_mm (captured)``/``fused_moe (captured)``: the same replayed from a device graph, which
  removes the host's launch overhead (a decode step runs captured in the engine).

Each time is the median of calls with the caches flushed before each (as triton's ``do_bench``:
:func:`~vllm_port.bench._timing.cold_median_ms`). Rates: GB/s of the active experts' weight bytes
(the experts some token chose, each read once: the decode floor) against the device's copy
bandwidth, and TFLOP/s of the routed products (``2 x tokens x top_k x 3 x intermediate x hidden``).
Each implementation's output is compared with the float32 reference first (max abs error printed).
Where ``fused_moe`` is bound to the Triton kernels, a row shows them with a decode step's routing in
``route``'s torch ops instead of their one program (``TritonTarget.moe_route_small``), and ``--sweep``
adds a row per candidate of :data:`SWEEP_TILES` (the same kernels launched with other tiles: what to put
in the plugin's ``TritonTarget``), each eager and captured.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import vllm_port

from ..kernels.triton_target import MoeTiles
from ..ops.moe import fused_moe_reference, route
from ._timing import cold_median_ms, copy_bandwidth_gbs, load_average

__all__ = ["SHAPES", "SWEEP_TILES", "main"]

#: name -> (hidden, intermediate, experts, top_k, renormalize)
SHAPES: dict[str, tuple[int, int, int, int, bool]] = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, True),
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
    "deepseek-v2-lite": (2048, 1408, 64, 6, False),
    "tiny": (64, 32, 8, 2, True),  # a CPU smoke run
}


#: Tiles ``--sweep`` tries (block_m, block_n, block_k, warps, stages): narrow ones for decode, wide for prefill.
SWEEP_TILES = (
    MoeTiles(16, 16, 256, 4, 4),
    MoeTiles(16, 32, 128, 2, 5),
    MoeTiles(16, 32, 128, 4, 4),
    MoeTiles(16, 64, 128, 4, 4),
    MoeTiles(16, 32, 256, 4, 3),
    MoeTiles(32, 64, 64, 4, 3),
    MoeTiles(64, 128, 64, 4, 3),
    MoeTiles(64, 128, 64, 8, 4),
    MoeTiles(128, 128, 64, 8, 3),
    MoeTiles(128, 256, 64, 8, 2),
)


def _sweep(ops: Any, tiles: bool = True) -> dict[str, Callable[..., Any]]:
    """Variants of the bound Triton kernels (none if ``fused_moe`` is not bound to them): routed by ``route``'s
    torch ops instead of one program, and (``tiles``) launched with each of :data:`SWEEP_TILES`."""
    kernels = getattr(ops.providers["fused_moe"].fn, "__self__", None)
    target = getattr(kernels, "target", None)
    if target is None or not hasattr(target, "moe_small"):
        return {}
    found = {}
    if target.moe_route_small:
        found["fused_moe, torch routing"] = type(kernels)(dataclasses.replace(target, moe_route_small=False)).fused_moe
    for t in SWEEP_TILES if tiles else ():
        tiled = dataclasses.replace(target, moe_small=t, moe_large=t)
        found[f"tiles {t.block_m}x{t.block_n}x{t.block_k} w{t.warps} s{t.stages}"] = type(kernels)(tiled).fused_moe
    return found


def _grouped_mm_layer(x, logits, w13, w2, top_k, renormalize) -> torch.Tensor:
    """The layer through ``torch._grouped_mm``: pairs sorted by expert, two grouped GEMMs, a weighted scatter-add."""
    weights, ids = route(logits, top_k, "softmax", renormalize, 1.0)
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    tokens = order // top_k
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)  # no bincount: it reads back the largest id (no graph capture)
    h = torch._grouped_mm(x[tokens], w13.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.flatten()[order, None])
    return out.to(x.dtype)


def _captured(fn: Callable[[], Any], runtime: Any) -> Callable[[], Any] | None:
    """``fn`` replayed from the platform's device graph, or None where the platform captures none."""
    capture = runtime.graph_capture()
    if capture is None:
        return None
    return capture.capture(fn)


def main(
    device: str | None,
    shape: str,
    tokens: list[int],
    dtype_name: str,
    json_path: str | None,
    seed: int = 0,
    sweep: bool = False,
) -> int:
    """Run the benchmark; print one row per (tokens, implementation) and write ``json_path``; exit status 0."""
    runtime = vllm_port.load(device=device)
    dev, dtype = runtime.device, getattr(torch, dtype_name)
    ops = runtime.bind(dtype)
    hidden, inter, experts, top_k, renorm = SHAPES[shape]
    gen = torch.Generator(dev).manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=dev) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=dev) * inter**-0.5).to(dtype)
    copy = copy_bandwidth_gbs(dev, 1 << 30 if dev.type != "cpu" else 1 << 26)
    result: dict[str, Any] = {
        "shape": shape, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k,
        "dtype": dtype_name, "platform": runtime.platform.name, "torch": torch.__version__,
        "provider": ops.providers["fused_moe"].name, "copy_gbs": copy, "load_average": load_average(), "rows": [],
    }  # fmt: skip
    print(f"{shape} layer on {runtime.platform.name} ({dtype_name}), fused_moe bound to {result['provider']}; "
          f"copy {copy:.0f} GB/s; load average {result['load_average']}")  # fmt: skip
    for n in tokens:
        x = torch.randn(n, hidden, generator=gen, device=dev).to(dtype)
        logits = torch.randn(n, experts, generator=gen, device=dev).to(dtype)
        _, ids = route(logits, top_k, "softmax", renorm, 1.0)
        active = int(ids.unique().numel())
        nbytes = active * 3 * inter * hidden * dtype.itemsize
        flops = 2 * n * top_k * 3 * inter * hidden
        want = fused_moe_reference(x.float(), logits, w13.float(), w2.float(), top_k, "softmax", renorm)
        impls: dict[str, Callable[[], Any]] = {
            "fused_moe": lambda x=x, lg=logits: ops.fused_moe(x, lg, w13, w2, top_k, "softmax", renorm),
        }
        if hasattr(torch, "_grouped_mm") and dev.type == "cuda":
            impls["grouped_mm"] = lambda x=x, lg=logits: _grouped_mm_layer(x, lg, w13, w2, top_k, renorm)
        for name, fn in _sweep(ops, tiles=sweep).items():
            impls[name] = lambda x=x, lg=logits, fn=fn: fn(x, lg, w13, w2, top_k, "softmax", renorm)
        for name in list(impls):  # the sweep's tiles too: at decode an eager call times the launches, not the tiles
            try:
                graph = _captured(impls[name], runtime)
            except Exception as exc:  # a kernel that cannot be captured is reported, not fatal
                print(f"  {name}: not captured ({type(exc).__name__}: {str(exc)[:120]})")
                graph = None
            if graph is not None:
                impls[f"{name} (captured)"] = graph
        for name, fn in impls.items():
            row: dict[str, Any] = {"tokens": n, "impl": name, "active_experts": active}
            try:
                out = fn()
                if "captured" not in name:
                    row["max_abs_error"] = float((out.float() - want).abs().max())
                ms = cold_median_ms(fn, dev, repeat=25 if n <= 64 else 10)
            except Exception as exc:  # a peer that cannot run here (no grouped GEMM on this device) is reported
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(f"{n:>6} {name:<28} error: {row['error']}")
                result["rows"].append(row)
                continue
            row.update(us=ms * 1e3, gbs=nbytes / ms / 1e6, tflops=flops / ms / 1e9)
            row["copy_fraction"] = row["gbs"] / copy
            result["rows"].append(row)
            error = f"  max|err| {row['max_abs_error']:.3g}" if "max_abs_error" in row else ""
            print(f"{n:>6} {name:<28} {row['us']:>10.1f} us  {row['gbs']:>7.0f} GB/s ({row['copy_fraction']:>4.0%} of "
                  f"copy, {active} experts)  {row['tflops']:>6.1f} TFLOP/s{error}", flush=True)  # fmt: skip
        if json_path:
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    return 0
