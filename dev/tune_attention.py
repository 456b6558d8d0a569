"""Sweep the CUDA target's attention knobs on the GPU, beside torch's SDPA (cuDNN, flash) and a copy.

    python3 dev/tune_attention.py [--quick] [--json FILE]     # sweep the knobs
    python3 dev/tune_attention.py --shipped [--json FILE]     # the shipped CUDA target beside its peers

Prefill: one sequence of 8192 tokens, 32 query / 8 KV heads, head 128, bf16, its 16-token KV blocks
scattered across a cache twice its size (the engine's layout); also with 128-token blocks (one block
per key tile: no gather) to show what the gather costs. Peers: torch SDPA through cuDNN and through
flash on the same problem with K/V contiguous (GQA expanded). TFLOP/s count the causal half.
Decode: 1 x 32k, 8 x 8k and 256 x 1k context, same heads; GB/s count K/V read once, against a device
copy measured in the same run. Every time is triton's ``do_bench`` median (L2 flushed before each
call); decode also as a CUDA-graph replay (how the engine launches it), flush time subtracted, the L2
flushed by reading (see ``graph_cold_us``; ``--shipped`` prints both flushes).

The knobs are searched a group at a time (tiles x warps x stages; then warp specialisation for
prefill, programs per SM for decode's key split), and the ``TritonTarget`` fields to set are printed.
On CPU (``TRITON_INTERPRET=1``, ``--smoke``) it runs tiny shapes once, to test the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.kernels.triton import CUDA, INTERPRETER, TritonTarget
from vllm_port.kernels.triton.attention import AttentionKernels

HEADS, KV_HEADS, HEAD = 32, 8, 128
DTYPE = torch.bfloat16
KNOBS = ("attn_", "decode_", "prefill_")  # the TritonTarget fields this script tunes
PREFILL_TOKENS = 8192
DECODE_SHAPES = ((1, 32768), (8, 8192), (256, 1024))
PREFILL_TILES = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
QUICK_PREFILL_TILES = [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 2)]
#: Tiles tried on larger cache blocks (a key tile inside one block), with and without TMA.
LAYOUT_TILES = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3)]
LAYOUT_BLOCK_SIZES = (64, 128)
DECODE_TILES = [(bn, w, s) for bn in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
PROGRAMS_PER_SM = (4, 8, 16, 32)
MIN_TILES_PER_SPLIT = (1, 2, 4)


def cold_us(fn) -> float:
    """Median microseconds of one call, the L2 flushed before each (triton's do_bench)."""
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def graph_cold_us(fn, calls: int = 20, flush_by: str = "read") -> float:
    """Microseconds of one call replayed from a CUDA graph, each after an L2 flush (the flush's time subtracted).

    ``flush_by="read"`` evicts the L2 by reading 256 MiB (it then holds clean lines, as after a decode
    step's weight reads); ``"write"`` by zeroing them (triton's do_bench): the dirty lines left behind are
    written back while the next call runs, which charges a read-only kernel up to the L2's size of writes.
    """
    flush = torch.zeros(256 << 20, dtype=torch.int8, device="cuda")
    evict = (lambda: flush.sum()) if flush_by == "read" else flush.zero_

    def replay_ms(with_fn: bool) -> float:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                evict()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(5):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        return sorted(times)[2]

    return (replay_ms(True) - replay_ms(False)) * 1e3 / calls


def paged_cache(lengths: list[int], block_size: int, device: str, gen: torch.Generator):
    """K/V caches holding ``lengths`` tokens per sequence in scattered blocks (twice the blocks needed)."""
    need = [math.ceil(n / block_size) for n in lengths]
    num_blocks = 2 * sum(need)
    shape = (num_blocks, block_size, KV_HEADS, HEAD)
    k = torch.randn(shape, device=device, dtype=DTYPE, generator=gen)
    v = torch.randn(shape, device=device, dtype=DTYPE, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(lengths), max(need), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = order[used : used + n]
        used += n
    return k, v, tables


def target_with(**fields) -> TritonTarget:
    return dataclasses.replace(BASE, **fields)


def prefill(tokens: int, block_size: int, device: str):
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(tokens, HEADS, HEAD, device=device, dtype=DTYPE, generator=gen)
    k, v, tables = paged_cache([tokens], block_size, device, gen)
    cu = torch.tensor([0, tokens], device=device, dtype=torch.int32)
    lens = torch.tensor([tokens], device=device, dtype=torch.int32)
    flops = 4 * HEADS * HEAD * tokens * (tokens + 1) // 2
    return (q, k, v, tables, cu, lens, tokens, HEAD**-0.5), flops


def sdpa_peer(q: torch.Tensor, backend) -> tuple:
    qs = q.transpose(0, 1)[None].contiguous()
    ks, vs = torch.randn_like(qs), torch.randn_like(qs)

    def run():
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    return run


def decode(seqs: int, context: int, device: str, block_size: int = 16):
    gen = torch.Generator(device).manual_seed(seqs)
    q = torch.randn(seqs, HEADS, HEAD, device=device, dtype=DTYPE, generator=gen)
    k, v, tables = paged_cache([context] * seqs, block_size, device, gen)
    lens = torch.full((seqs,), context, device=device, dtype=torch.int32)
    nbytes = 2 * seqs * context * KV_HEADS * HEAD * q.element_size()
    return (q, k, v, tables, lens, HEAD**-0.5), nbytes


def timed(fn) -> float | str:
    """Microseconds per call (do_bench), or why the variant did not run."""
    try:
        fn()
        if not torch.cuda.is_available():  # --smoke: one interpreted call, wall clock
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e6
        return cold_us(fn)
    except Exception as e:  # a config the compiler refuses (shared memory, warp specialisation)
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def prefill_row(rows: list, system: str, us: float | str, flops: int, **extra) -> float:
    """Record and print one prefill timing; returns the time (inf where it failed)."""
    ok = isinstance(us, float)
    rows.append({"kind": "prefill", "system": system, "us": us, "tflops": flops / us / 1e6 if ok else 0, **extra})
    print(f"prefill {system:48s} " + (f"{us:9.1f} us {flops / us / 1e6:6.1f} TFLOP/s" if ok else str(us)))
    return us if ok else float("inf")


def sweep_prefill(quick: bool, device: str, tokens: int, rows: list) -> TritonTarget:
    args, flops = prefill(tokens, 16, device)
    if device == "cuda":
        for name, backend in (
            ("torch sdpa cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
            ("torch sdpa flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
        ):
            prefill_row(rows, name, timed(sdpa_peer(args[0], backend)), flops)
    prefill_row(
        rows, "triton as shipped, block16", timed(lambda: AttentionKernels(BASE).prefill_attention(*args)), flops
    )
    best, best_us = BASE, float("inf")
    for bm, bn, w, st in QUICK_PREFILL_TILES if quick else PREFILL_TILES:
        for ws in (False, True):
            t = target_with(attn_block_m=bm, attn_block_n=bn, attn_warps=w, attn_stages=st, prefill_warp_specialize=ws)
            us = timed(lambda t=t: AttentionKernels(t).prefill_attention(*args))
            us = prefill_row(rows, f"triton block16 m{bm} n{bn} w{w} s{st} ws={int(ws)}", us, flops)
            if us < best_us:
                best, best_us = t, us
    for block_size in LAYOUT_BLOCK_SIZES if device == "cuda" else (32,):
        args_b, _ = prefill(tokens, block_size, device)
        for bm, bn, w, st in LAYOUT_TILES if device == "cuda" else [(16, 16, 4, 1)]:
            for tma, ws in ((False, False), (True, False), (True, True)):
                t = target_with(attn_block_m=bm, attn_block_n=bn, attn_warps=w, attn_stages=st, prefill_tma=tma,
                                prefill_warp_specialize=ws)  # fmt: skip
                us = timed(lambda t=t, a=args_b: AttentionKernels(t).prefill_attention(*a))
                label = f"triton block{block_size} m{bm} n{bn} w{w} s{st} tma={int(tma)} ws={int(ws)}"
                prefill_row(rows, label, us, flops, block_size=block_size)
    return best


def sweep_decode(quick: bool, device: str, best_prefill: TritonTarget, rows: list, copy_gbs: float) -> TritonTarget:
    """Decode variants scored by the geometric mean of their times over the shapes, as CUDA-graph replays."""
    shapes = DECODE_SHAPES if device == "cuda" else ((1, 256), (2, 64))
    cases = [(seqs, ctx, *decode(seqs, ctx, device)) for seqs, ctx in shapes]

    def label(t: TritonTarget) -> str:
        return (f"n{t.decode_block_n} w{t.decode_warps} s{t.decode_stages} ev{int(t.decode_early_v)} "
                f"per_sm{t.decode_programs_per_sm} min{t.decode_min_tiles_per_split}")  # fmt: skip

    def score(t: TritonTarget, name: str) -> float:
        total = 0.0
        for seqs, ctx, args, nbytes in cases:
            run = lambda t=t, args=args: AttentionKernels(t).paged_attention(*args)  # noqa: E731
            us = timed(run)
            if isinstance(us, float) and device == "cuda":  # as the engine launches it
                us = graph_cold_us(run)
            row = {"kind": "decode", "shape": f"{seqs}x{ctx}", "system": name, "us": us}
            rows.append(row)
            if not isinstance(us, float):
                print(f"decode {seqs:>3}x{ctx:<6} {name:44s} {us}")
                return float("inf")
            row["gbs"] = nbytes / us / 1e3
            row["of_copy"] = row["gbs"] / copy_gbs
            print(f"decode {seqs:>3}x{ctx:<6} {name:44s} {us:8.1f} us {row['gbs']:7.0f} GB/s {row['of_copy']:6.1%}")
            total += math.log(us)
        return total

    best = best_prefill
    best_score = score(best, "as shipped " + label(best))
    start = dataclasses.replace(best_prefill, decode_programs_per_sm=16, decode_min_tiles_per_split=2)
    for bn, w, st in DECODE_TILES:
        for early_v in (False, True):
            t = dataclasses.replace(start, decode_block_n=bn, decode_warps=w, decode_stages=st, decode_early_v=early_v)
            sc = score(t, label(t))
            if sc < best_score:
                best, best_score = t, sc
    for per_sm in PROGRAMS_PER_SM:
        for min_tiles in MIN_TILES_PER_SPLIT:
            t = dataclasses.replace(best, decode_programs_per_sm=per_sm, decode_min_tiles_per_split=min_tiles)
            sc = score(t, label(t))
            if sc < best_score:
                best, best_score = t, sc
    return best


def shipped(rows: list, copy_gbs: float) -> None:
    """The shipped CUDA target beside the peers: prefill and decode on 16- and 128-token cache blocks."""
    for block_size in (16, 128):
        args, flops = prefill(PREFILL_TOKENS, block_size, "cuda")
        if block_size == 16:
            for name, backend in (
                ("torch sdpa cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                ("torch sdpa flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION),
            ):
                prefill_row(rows, name + " (contiguous K/V)", timed(sdpa_peer(args[0], backend)), flops)
        run = lambda a=args: AttentionKernels(CUDA).prefill_attention(*a)  # noqa: E731
        prefill_row(rows, f"triton, {block_size}-token blocks", timed(run), flops, block_size=block_size)
    for seqs, ctx in DECODE_SHAPES:
        for block_size in (16, 128):
            args, nbytes = decode(seqs, ctx, "cuda", block_size)
            run = lambda a=args: AttentionKernels(CUDA).paged_attention(*a)  # noqa: E731
            run()
            times = {"do_bench": cold_us(run), "graph, read flush": graph_cold_us(run, flush_by="read"),
                     "graph, write flush": graph_cold_us(run, flush_by="write")}  # fmt: skip
            for how, us in times.items():
                gbs = nbytes / us / 1e3
                rows.append({"kind": "decode", "shape": f"{seqs}x{ctx}", "block_size": block_size, "timing": how,
                             "us": us, "gbs": gbs, "of_copy": gbs / copy_gbs})  # fmt: skip
                print(f"decode {seqs:>3}x{ctx:<6} block {block_size:<3} {how:20s} {us:8.1f} us {gbs:7.0f} GB/s "
                      f"{gbs / copy_gbs:6.1%}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few prefill tiles, not the whole grid")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): test the script")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--shipped", action="store_true", help="only the shipped CUDA target beside its peers")
    parser.add_argument("--json", default=None, help="write every row here")
    args = parser.parse_args(argv)
    global BASE
    device = "cpu" if args.smoke else "cuda"
    BASE = INTERPRETER if args.smoke else CUDA
    if args.smoke:
        global PREFILL_TILES, QUICK_PREFILL_TILES, DECODE_TILES, PROGRAMS_PER_SM, MIN_TILES_PER_SPLIT
        QUICK_PREFILL_TILES = PREFILL_TILES = [(16, 16, 4, 1)]
        DECODE_TILES = [(16, 4, 1)]
        PROGRAMS_PER_SM, MIN_TILES_PER_SPLIT = (4,), (1,)
    rows: list = []
    copy_gbs = copy_bandwidth_gbs(torch.device(device), 1 << 30) if device == "cuda" else 1.0
    print(f"device copy {copy_gbs:.0f} GB/s; torch {torch.__version__}, triton {triton.__version__}")
    if args.shipped:
        shipped(rows, copy_gbs)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"copy_gbs": copy_gbs, "rows": rows}, f, indent=1)
        return 0
    best = BASE if args.skip_prefill else sweep_prefill(args.quick, device, 64 if args.smoke else PREFILL_TOKENS, rows)
    best = sweep_decode(args.quick, device, best, rows, copy_gbs)
    fields = {f.name: getattr(best, f.name) for f in dataclasses.fields(best) if f.name.startswith(KNOBS)}
    print("best:", ", ".join(f"{k}={v}" for k, v in fields.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "rows": rows, "best": fields}, f, indent=1)
    return 0


BASE: TritonTarget = CUDA

if __name__ == "__main__":
    sys.exit(main())
