"""Decode attention at small batch and long context on the GPU: split counts, the merge kernel's cost, 16- vs 128-token
blocks, TMA (graph replays, L2 flushed by zeroing). Run from the repository root: python3 dev/experiments/probe_decode_splits.py
"""

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dev/: tune_attention
import tune_attention as ta

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.kernels.triton import attention as A
from vllm_port_cuda.triton_targets import CUDA

copy = copy_bandwidth_gbs(torch.device("cuda"), 1 << 30)
print(f"copy {copy:.0f} GB/s")
real_merge = A._merge_splits_kernel


class NoMerge:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def decode_case(seqs, ctx, block_size):
    gen = torch.Generator("cuda").manual_seed(seqs)
    q = torch.randn(seqs, ta.HEADS, ta.HEAD, device="cuda", dtype=ta.DTYPE, generator=gen)
    k, v, tables = ta.paged_cache([ctx] * seqs, block_size, "cuda", gen)
    lens = torch.full((seqs,), ctx, device="cuda", dtype=torch.int32)
    return (q, k, v, tables, lens, ta.HEAD**-0.5), 2 * seqs * ctx * ta.KV_HEADS * ta.HEAD * 2


def run(t, args, splits, merge=True):
    A._merge_splits_kernel = real_merge if merge else NoMerge()
    try:

        def fn():
            return A.AttentionKernels(t)._decode(*args, 0, 0.0, num_splits=splits)

        fn()
        torch.cuda.synchronize()
        return ta.graph_cold_us(fn)
    except Exception as e:
        return f"failed {type(e).__name__}: {str(e)[:80]}"
    finally:
        A._merge_splits_kernel = real_merge


for seqs, ctx in ((1, 32768), (8, 8192), (256, 1024)):
    for bs in (16, 128):
        args, nbytes = decode_case(seqs, ctx, bs)
        for bn, w, st in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 3)):
            for tma in (False, True) if bs == 128 else (False,):
                t = dataclasses.replace(CUDA, decode_block_n=bn, decode_warps=w, decode_stages=st, decode_tma=tma)
                for splits in (1,) if seqs == 256 else (16, 32, 64, 128, 256):
                    if splits * 4 > ctx // bn and splits > 16:
                        continue
                    full = run(t, args, splits)
                    main = run(t, args, splits, merge=False) if splits > 1 else full

                    def fmt(us, nbytes=nbytes):
                        return f"{us:7.1f} us {nbytes / us / 1e3 / copy:6.1%}" if isinstance(us, float) else us

                    print(
                        f"{seqs:>3}x{ctx:<6} block{bs:<4} n{bn} w{w} s{st} tma={int(tma)} splits {splits:>3}: "
                        f"full {fmt(full)} | main only {fmt(main)}",
                        flush=True,
                    )
