"""fp8_linear at one row (batch-1 decode): the one-row kernel (weight widened in registers) against the quantised path.

Measured on the GPU, per call, replaying one CUDA graph of calls over 8 copies of the weight (more bytes
than the L2, as a decode step's layers are): Llama-3-8B's and Qwen3-30B-A3B's projections at one row,
bf16 activations, e4m3 weights with per-channel scales. Columns: the bf16 one-row ``linear`` kernel on a
bf16 weight (the dense baseline), ``fp8_linear`` as before (quantise, FP8 dot, split-K reduce: three
launches), ``fp8_linear`` on the one-row kernel at several tiles, and ``torch._scaled_mm`` (cuBLASLt) on
activations already quantised. GB/s counts the weight's bytes; copy bandwidth from the same process.
Each path is checked against the op's oracle first. Usage: ``python3 dev/experiments/probe_fp8_one_row.py [OUT.json]``
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.bench.fp8_linear import SHAPES  # the projections `vllm-port bench fp8-linear` times
from vllm_port.kernels.triton.fp8_linear import Fp8LinearKernels
from vllm_port.kernels.triton.linear import LinearKernels
from vllm_port.kernels.triton_target import LinearTiles
from vllm_port.ops import fp8_linear
from vllm_port.ops.fp8 import quantize_fp8_weight
from vllm_port_cuda.triton_targets import CUDA

TILES = [LinearTiles(16, 1024, 4, 2, 1), LinearTiles(16, 512, 4, 2, 1), LinearTiles(32, 1024, 4, 2, 1),
         LinearTiles(16, 2048, 4, 2, 1), LinearTiles(8, 1024, 4, 3, 1), LinearTiles(16, 1024, 8, 3, 1),
         LinearTiles(16, 1024, 4, 3, 2)]  # fmt: skip
COPIES = 8


def graph_us(fn, calls) -> float:
    """Per call: one CUDA graph of ``fn`` over ``calls`` (after a warm-up outside the graph), replayed 20 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in calls:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in calls:
            fn(*args)
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * begin.elapsed_time(end) / (20 * len(calls))


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device, 1 << 30)
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (k, n) in SHAPES.items():
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        dense = [torch.randn(n, k, generator=gen).to(device, torch.bfloat16) / k**0.5 for _ in range(COPIES)]
        quantised = [quantize_fp8_weight(w.float().cpu(), "channel") for w in dense]
        fp8 = [(x, q.to(device), s.to(device), None) for q, s in quantised]
        row = {"shape": name, "k": k, "n": n, "copy_gbs": copy}
        bf16 = LinearKernels(CUDA)
        row["bf16 linear us"] = graph_us(bf16.linear, [(x, w) for w in dense])
        paths = {"fp8 quantised (3 launches)": Fp8LinearKernels(dataclasses.replace(CUDA, fp8_one_row=None))}
        for t in TILES:
            label = f"fp8 one row {t.block_n}x{t.block_k} w{t.warps} s{t.stages} v{t.waves}"
            paths[label] = Fp8LinearKernels(dataclasses.replace(CUDA, fp8_one_row=t))
        for label, kernels in paths.items():
            problem = fp8_linear.check(kernels.fp8_linear, fp8[0], torch.bfloat16)
            row[f"{label} ok"] = problem is None
            row[f"{label} us"] = graph_us(kernels.fp8_linear, fp8)
        xq = x.to(torch.float8_e4m3fn)  # a stand-in for the quantised row: cuBLASLt's time, not its accuracy
        one = torch.ones((1, 1), device=device)
        scaled = [(q.to(device), s.to(device).view(1, -1)) for q, s in quantised]
        try:
            row["torch._scaled_mm us"] = graph_us(
                lambda w, s, a=xq, o=one: torch._scaled_mm(a, w.t(), scale_a=o, scale_b=s, out_dtype=torch.bfloat16),
                scaled,
            )
        except RuntimeError as exc:  # a scaling layout this torch's cuBLASLt refuses: said, not fatal
            row["torch._scaled_mm error"] = str(exc).splitlines()[0]
        for key in [key for key in row if key.endswith(" us")]:
            nbytes = n * k * (2 if key.startswith("bf16") else 1)
            row[key.replace(" us", " of copy")] = round(nbytes / (row[key] * 1e-6) / 1e9 / copy, 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
