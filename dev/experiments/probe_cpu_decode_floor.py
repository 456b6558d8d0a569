"""What a CPU decode step of ``bench engine``'s models cannot go below: its GEMMs, its attention's bytes, a copy.

    .venv/bin/python dev/experiments/probe_cpu_decode_floor.py [--model engine|768] [--threads 2] --json OUT
    /work/vllm-peer/bin/python dev/experiments/probe_cpu_decode_floor.py --gemm vllm ...   # vLLM's own GEMM

A decode step of 64 sequences runs every linear of the model on 64 rows: qkv, o, gate_up and down in
each layer, and the LM head. Each is timed alone here (bfloat16, weights made once, the best of 7
rounds of 20 calls) through this project's ``cpu_linear`` provider (oneDNN with the weight packed
once) or, under vLLM's venv with ``--gemm vllm``, through vLLM's ``onednn_mm`` (the GEMM vLLM's CPU
build runs for these layers), and summed as a step runs them: the step's GEMM time, which no engine
on these cores avoids. Under this project's venv it also times the CPU plugin's native
``paged_attention`` at the step's shape (context 192, the mean of 128 prompt + 128 output tokens;
blocks of 16 scattered over the cache, as a running engine's are) and a 256 MiB copy (the memory
bandwidth the attention's K/V reads are bounded by). Prints one line each and the load average;
the machine is shared, so compare rows of one sitting only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

#: hidden, intermediate, layers, heads, kv heads of bench engine's models (head 64, vocab 32000)
MODELS = {"engine": (512, 1536, 8, 8, 4), "768": (768, 2048, 12, 12, 4)}
ROWS, HEAD, VOCAB, BLOCK, CONTEXT = 64, 64, 32000, 16, 192


def best_ms(fn: Callable[[], object], rounds: int = 7, calls: int = 20) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return min(times) * 1e3


def gemm_shapes(hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int, int]]:
    """name -> (in features, out features, calls a step)."""
    qkv = (heads + 2 * kv_heads) * HEAD
    return {
        "qkv": (hidden, qkv, layers),
        "o": (heads * HEAD, hidden, layers),
        "gate_up": (hidden, 2 * inter, layers),
        "down": (inter, hidden, layers),
        "lm_head": (hidden, VOCAB, 1),
    }


def linear_fn(gemm: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    if gemm == "vllm":
        from vllm import _custom_ops as vllm_ops

        handler = vllm_ops.create_onednn_mm(weight.t(), 32)
        return lambda x: vllm_ops.onednn_mm(handler, x, None)
    from vllm_port_cpu.ops import linear

    return lambda x: linear.fn(x, weight)


def time_gemms(gemm: str, shapes: dict[str, tuple[int, int, int]]) -> dict[str, dict[str, float]]:
    out = {}
    for name, (k, n, calls) in shapes.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        x = torch.randn(ROWS, k, dtype=torch.bfloat16)
        fn = linear_fn(gemm, weight)
        ms = best_ms(lambda fn=fn, x=x: fn(x))
        out[name] = {"ms": ms, "calls": calls, "gflops": 2 * ROWS * k * n / ms / 1e6}
    return out


def time_attention(heads: int, kv_heads: int) -> dict[str, float]:
    from vllm_port_cpu import native

    gen = torch.Generator().manual_seed(0)
    per_seq = (CONTEXT + BLOCK - 1) // BLOCK
    num_blocks = ROWS * per_seq * 2
    caches = [torch.randn(num_blocks, BLOCK, kv_heads, HEAD, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
    tables = torch.randperm(num_blocks, generator=gen)[: ROWS * per_seq].view(ROWS, per_seq).to(torch.int32)
    lens = torch.full((ROWS,), CONTEXT, dtype=torch.int32)
    query = torch.randn(ROWS, heads, HEAD, dtype=torch.bfloat16, generator=gen)
    ms = best_ms(lambda: native.paged_attention.fn(query, *caches, tables, lens, HEAD**-0.5))
    kv_bytes = 2 * ROWS * CONTEXT * kv_heads * HEAD * 2
    return {"ms": ms, "kv_bytes": kv_bytes, "gb_s": kv_bytes / ms / 1e6}


def time_copy() -> dict[str, float]:
    src = torch.randn(128 * 1024 * 1024, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = best_ms(lambda: dst.copy_(src), rounds=5, calls=3)
    return {"ms": ms, "gb_s": 2 * src.numel() * 2 / ms / 1e6}  # read and write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="768")
    parser.add_argument("--gemm", choices=["vllm-port", "vllm"], default="vllm-port")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden, inter, layers, heads, kv_heads = MODELS[args.model]
    load_before = os.getloadavg()[0]
    result: dict[str, object] = {"model": args.model, "gemm": args.gemm, "threads": args.threads, "rows": ROWS}
    gemms = time_gemms(args.gemm, gemm_shapes(hidden, inter, layers, heads, kv_heads))
    for name, g in gemms.items():
        print(f"{args.gemm} {name:8s} x{g['calls']:<3d} {g['ms']:.3f} ms  {g['gflops']:.0f} GFLOP/s")
    step = sum(g["ms"] * g["calls"] for g in gemms.values())
    print(f"{args.gemm}: the step's GEMMs {step:.1f} ms")
    result.update(gemms=gemms, step_gemm_ms=step)
    if args.gemm == "vllm-port":
        attention = time_attention(heads, kv_heads)
        copy = time_copy()
        print(
            f"native paged_attention, context {CONTEXT}: {attention['ms']:.3f} ms a layer ({attention['gb_s']:.1f} GB/s "
            f"of K/V), {attention['ms'] * layers:.1f} ms a step; copy {copy['gb_s']:.1f} GB/s (read + write)"
        )
        result.update(attention=attention, attention_step_ms=attention["ms"] * layers, copy=copy)
    result["load_average"] = [load_before, os.getloadavg()[0]]
    print(f"load average before/after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
