"""A replayed prefill step's attention (one paged-attention row per token) against the prefill kernel, on the GPU.

Measured: one layer of Llama-3-8B's attention (32 query / 8 KV heads of 128, bf16, the platform's KV block
size), a chunk of ``Q`` new tokens of one sequence whose context ends at ``C``: the bound ``paged_attention``
over ``Q`` rows (row ``t``'s context ends at its token, as ``ModelRunner._replay`` launches it) and the
bound ``prefill_attention`` over the chunk, each timed cold (L2 flushed, device events). The difference
times the layers is what replaying such a step costs in attention; the engine's eager step costs its
launches. Result: docs/results/mixed-capture-h200.md. Usage: ``python3 dev/experiments/probe_token_rows.py``
"""

from __future__ import annotations

import json
import sys

import torch

import vllm_port
from vllm_port.bench._timing import cold_median_ms

HEADS, KV_HEADS, HEAD = 32, 8, 128
CHUNKS = (64, 256, 512, 1024, 2048)
CONTEXTS = (1024, 2048, 4096, 8192, 16384)


def measure(ops, device: torch.device, block: int, chunk: int, context: int) -> dict:
    """One chunk of ``chunk`` tokens ending at ``context``: both ways, cold, in microseconds."""
    blocks = -(-context // block)
    k = torch.randn(blocks + 1, block, KV_HEADS, HEAD, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(blocks, device=device).to(torch.int32)[None, :] + 1
    q = torch.randn(chunk, HEADS, HEAD, device=device, dtype=torch.bfloat16)
    tokens = torch.arange(chunk, device=device, dtype=torch.int32)
    seq_lens = (context - chunk + 1 + tokens).to(torch.int32)
    tables = table.expand(chunk, -1).contiguous()
    cu = torch.tensor([0, chunk], device=device, dtype=torch.int32)
    total = torch.tensor([context], device=device, dtype=torch.int32)
    scale = HEAD**-0.5
    as_rows = cold_median_ms(lambda: ops.paged_attention(q, k, v, tables, seq_lens, scale, 0, 0.0), device)
    as_prefill = cold_median_ms(lambda: ops.prefill_attention(q, k, v, table, cu, total, chunk, scale, 0, 0.0), device)
    read = sum(range(context - chunk + 1, context + 1))  # context tokens the rows read, summed
    return dict(chunk=chunk, context=context, context_read=read, rows_us=1e3 * as_rows, prefill_us=1e3 * as_prefill,
                extra_32_layers_ms=32 * (as_rows - as_prefill))  # fmt: skip


def main() -> None:
    runtime = vllm_port.load()
    ops = runtime.bind(torch.bfloat16)
    device = torch.device(runtime.platform.device_type, 0)
    block = runtime.platform.kv_block_size
    paged, prefill = ops.providers["paged_attention"].name, ops.providers["prefill_attention"].name
    print(f"platform {runtime.platform.name}, block {block}; providers: paged {paged}, prefill {prefill}", flush=True)
    rows = []
    for chunk in CHUNKS:
        for context in (chunk, *CONTEXTS):
            if context < chunk or (context == chunk and chunk in CONTEXTS):
                continue
            rows.append(measure(ops, device, block, chunk, context))
            print(json.dumps(rows[-1]), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
