"""Decode attention with the split merge in the decode kernel (one launch) against the merge kernel (two), on the GPU.

Measured: Llama-3-8B's attention (32 query / 8 KV heads of 128, bf16, the platform's KV block size),
decode batches of 1-64 sequences at contexts of 640 and 4,096 tokens, with the CUDA target's split
rule; ``decode_fused_merge`` off and on in the same process. Two timings each:

- cold: one call, L2 flushed, device events (``cold_median_ms``, as triton's ``do_bench``);
- graph: 32 calls over 32 distinct caches (one per layer, more bytes than the L2) captured in one CUDA
  graph and replayed, per call: what a captured decode step pays, launch gaps inside the graph included.

Before timing, each batch is checked: both outputs within the op's tolerance of the reference, and the
fused output the same bits in 50 launches (a race between the splits would show as a differing output).
Result: docs/results/decode-split-h200.md. Usage: ``python3 dev/experiments/probe_fused_merge.py [OUT.json]``
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

import vllm_port
from vllm_port.bench._timing import cold_median_ms
from vllm_port.kernels.triton.attention import AttentionKernels
from vllm_port.ops import paged_attention

HEADS, KV_HEADS, HEAD, LAYERS = 32, 8, 128, 32
BATCHES = (1, 4, 16, 64)
CONTEXTS = (640, 4096)


def caches(device: torch.device, block: int, batch: int, context: int, gen: torch.Generator):
    blocks = batch * -(-context // block)
    k = torch.randn(blocks + 1, block, KV_HEADS, HEAD, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(blocks + 1, block, KV_HEADS, HEAD, generator=gen).to(device, torch.bfloat16)
    table = (torch.randperm(blocks, generator=gen) + 1).to(device, torch.int32).view(batch, -1)
    return k, v, table


def graph_us(fn, layers) -> float:
    """Per call, replaying one graph of ``fn`` over every layer's inputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in layers:  # warm up outside the capture (compiles, allocations)
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in layers:
            fn(*args)
    for _ in range(5):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * begin.elapsed_time(end) / (50 * len(layers))


def main() -> None:
    runtime = vllm_port.load()
    device = torch.device(runtime.platform.device_type, 0)
    block = runtime.platform.kv_block_size
    from vllm_port_cuda.triton_targets import CUDA

    ways = {
        "two launches": AttentionKernels(dataclasses.replace(CUDA, decode_fused_merge=False)),
        "fused merge": AttentionKernels(dataclasses.replace(CUDA, decode_fused_merge=True)),
    }
    print(f"{torch.cuda.get_device_name()}; block {block}; {LAYERS} layers a graph", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            layers = []
            for _ in range(LAYERS):
                k, v, table = caches(device, block, batch, context, gen)
                q = torch.randn(batch, HEADS, HEAD, generator=gen).to(device, torch.bfloat16)
                lens = torch.full((batch,), context, dtype=torch.int32, device=device)
                layers.append((q, k, v, table, lens, HEAD**-0.5, 0, 0.0))
            fused = ways["fused merge"].paged_attention
            first = fused(*layers[0])
            same = all(torch.equal(fused(*layers[0]), first) for _ in range(50))
            row = {"batch": batch, "context": context, "fused_deterministic": same}
            for name, kernels in ways.items():
                row[f"{name} within tolerance"] = (
                    paged_attention.check(kernels.paged_attention, layers[0], torch.bfloat16) is None
                )
                row[f"{name} cold us"] = 1e3 * cold_median_ms(
                    lambda kk=kernels, a=layers[0]: kk.paged_attention(*a), device
                )
                row[f"{name} graph us"] = graph_us(kernels.paged_attention, layers)
            row["graph saved us (32 layers)"] = LAYERS * (row["two launches graph us"] - row["fused merge graph us"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
