"""Sweep the CUDA target's attention knobs on the GPU, beside torch's SDPA (cuDNN, flash) and a copy.

    python3 dev/tune_attention.py [--quick] [--json FILE]     # sweep the knobs
    python3 dev/tune_attention.py --shipped [--json FILE]     # the shipped CUDA kernels beside their peers
    python3 dev/tune_attention.py --shipped --smoke           # the same on CPU, tiny shapes (interpreter)

``--shipped`` measures the table of issue 17 in one run: the CUDA plugin's attention providers (its
K/V blocks scattered across a cache twice the size needed, as the engine lays them out) beside
torch SDPA through cuDNN and through flash on the same data with K/V contiguous. 32 query / 8 KV
heads, head 128, bf16. Prefill, causal: one sequence of 1k, 4k, 8k, 16k tokens, and 16 sequences of
512 new tokens after a cached prefix of 512 (query j of a sequence sits at position 512 + j: the
peers get that bottom-right-aligned causal mask). Decode: 1 x 32k, 8 x 8k, 64 x 4k, 256 x 1k context.
Rows on 128-token blocks (the CUDA platform's default), plus 16-token blocks for prefill 8k, the
prefix case and every decode shape. TFLOP/s count the causal part; decode GB/s count K/V read once,
against a device copy measured in the same run. Every time is triton's ``do_bench`` median (L2 flushed
before each call, the host's launch included); also as a CUDA-graph replay, flush time subtracted (see
``graph_cold_us``): decode (the engine launches it so) with the L2 flushed by reading and by writing,
prefill with it flushed by reading, to tell the host's launch from the kernel (the engine launches
prefill eagerly: its verdicts judge ``do_bench``; "graph vs" ratios sit beside). Every output (ours and
the peers') is checked against torch's math SDPA in float32 on sampled sequences and heads. Each case
runs in its own process (a kernel that faults loses its case, not the run); the goals of issue 17
are judged in the last columns.

The sweep searches the knobs a group at a time (tiles x warps x stages, TMA on larger blocks for prefill;
tiles, then programs per SM for decode's key split), and the ``TritonTarget`` fields to set are printed.
On CPU (``--smoke``) both modes run tiny shapes in Triton's interpreter, to test the script itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

if not torch.cuda.is_available():  # before any kernel is defined: Triton's CPU interpreter (--smoke)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.kernels.triton import INTERPRETER, TritonTarget
from vllm_port.kernels.triton.attention import AttentionKernels
from vllm_port.ops import paged_attention as PAGED_ATTENTION_OP
from vllm_port_cuda.triton_targets import CUDA

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


def prefill(tokens: int, block_size: int, device: str, seqs: int = 1, prefix: int = 0):
    """``seqs`` sequences of ``tokens`` query tokens after ``prefix`` cached ones: the op's arguments and FLOPs."""
    gen = torch.Generator(device).manual_seed(block_size)
    total = prefix + tokens
    q = torch.randn(seqs * tokens, HEADS, HEAD, device=device, dtype=DTYPE, generator=gen)
    k, v, tables = paged_cache([total] * seqs, block_size, device, gen)
    cu = torch.arange(seqs + 1, device=device, dtype=torch.int32) * tokens
    lens = torch.full((seqs,), total, device=device, dtype=torch.int32)
    seen = tokens * prefix + tokens * (tokens + 1) // 2  # keys the queries of one sequence see, summed
    flops = 4 * HEADS * HEAD * seqs * seen
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
        t = target_with(attn_block_m=bm, attn_block_n=bn, attn_warps=w, attn_stages=st)
        us = timed(lambda t=t: AttentionKernels(t).prefill_attention(*args))
        us = prefill_row(rows, f"triton block16 m{bm} n{bn} w{w} s{st}", us, flops)
        if us < best_us:
            best, best_us = t, us
    for block_size in LAYOUT_BLOCK_SIZES if device == "cuda" else (32,):
        args_b, _ = prefill(tokens, block_size, device)
        for bm, bn, w, st in LAYOUT_TILES if device == "cuda" else [(16, 16, 4, 1)]:
            for tma in (False, True):
                t = target_with(attn_block_m=bm, attn_block_n=bn, attn_warps=w, attn_stages=st, prefill_tma=tma)
                us = timed(lambda t=t, a=args_b: AttentionKernels(t).prefill_attention(*a))
                label = f"triton block{block_size} m{bm} n{bn} w{w} s{st} tma={int(tma)}"
                prefill_row(rows, label, us, flops, block_size=block_size)
    return best


def sweep_decode(quick: bool, device: str, best_prefill: TritonTarget, rows: list, copy_gbs: float) -> TritonTarget:
    """Decode variants scored by the geometric mean of their times over the shapes, as CUDA-graph replays."""
    shapes = DECODE_SHAPES if device == "cuda" else ((1, 256), (2, 64))
    cases = [(seqs, ctx, *decode(seqs, ctx, device)) for seqs, ctx in shapes]

    def label(t: TritonTarget) -> str:
        return (f"n{t.decode_block_n} w{t.decode_warps} s{t.decode_stages} "
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
        t = dataclasses.replace(start, decode_block_n=bn, decode_warps=w, decode_stages=st)
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


# ------------------------------------------------------------------------------------------------
# --shipped: issue 17's table
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    """``seqs`` sequences of ``new`` query tokens, each after ``prefix`` tokens already in the cache (causal)."""

    label: str
    seqs: int
    new: int
    prefix: int = 0
    block_sizes: tuple[int, ...] = (128,)
    cudnn_goal: float | None = None  # our speed at least this fraction of cuDNN's


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    """``seqs`` sequences of ``context`` cached tokens, one query token each (the last)."""

    label: str
    seqs: int
    context: int
    block_sizes: tuple[int, ...] = (128, 16)
    copy_goal: float | None = None  # graph-replay bandwidth at least this fraction of a device copy's


FLASH_GOAL = 1.0  # prefill at least as fast as SDPA flash, everywhere
SHIPPED_CASES: tuple[PrefillCase | DecodeCase, ...] = (
    PrefillCase("1 x 1k", 1, 1024),
    PrefillCase("1 x 4k", 1, 4096),
    PrefillCase("1 x 8k", 1, 8192, block_sizes=(128, 16), cudnn_goal=0.9),
    PrefillCase("1 x 16k", 1, 16384, cudnn_goal=0.9),
    PrefillCase("16 x 512 after 512", 16, 512, 512, block_sizes=(128, 16)),
    DecodeCase("1 x 32k", 1, 32768, copy_goal=0.8),
    DecodeCase("8 x 8k", 8, 8192, copy_goal=0.8),
    DecodeCase("64 x 4k", 64, 4096),
    DecodeCase("256 x 1k", 256, 1024),
)
#: The same kinds of rows, small enough for the interpreter: tiles of 128 crossed, a prefix that is not.
SMOKE_CASES: tuple[PrefillCase | DecodeCase, ...] = (
    PrefillCase("1 x 130", 1, 130, block_sizes=(128, 16), cudnn_goal=0.9),
    PrefillCase("1 x 257", 1, 257),
    PrefillCase("3 x 100 after 150", 3, 100, 150, block_sizes=(128, 16)),
    DecodeCase("1 x 700", 1, 700, copy_goal=0.8),
    DecodeCase("3 x 300", 3, 300),
)
CASE_TIMEOUT_S = 200  # one case's process, compiles included (about 20 s each when the Triton cache is warm)
PEERS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
#: --smoke on CPU: torch's math backend stands in for both, so the peers' code paths run too.
SMOKE_PEERS = {"cudnn": SDPBackend.MATH, "flash": SDPBackend.MATH}


def shipped_providers() -> dict[str, Callable]:
    """The CUDA plugin's highest-priority provider of each attention op: what it binds on an H200."""
    from vllm_port_cuda.ops import providers

    best: dict = {}
    for p in providers():
        if p.op in ("prefill_attention", "paged_attention") and (p.op not in best or p.priority > best[p.op].priority):
            best[p.op] = p
    return best


def provider_label(provider) -> str:
    """The provider's name, with the Triton target it launches with (the plugin picks it by compute capability)."""
    target = getattr(getattr(provider.fn, "__self__", None), "target", None)
    return f"{provider.name} (target {getattr(target, 'name', 'unknown')}, priority {provider.priority})"


def why(e: BaseException, caught: list | None = None) -> str:
    """One line saying why a call failed, with the warnings torch gave for refusing a backend."""
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    reasons = dict.fromkeys(str(w.message).strip().splitlines()[0][:160] for w in caught or ())
    return text + (" [" + " / ".join(reasons)[:400] + "]" if reasons else "")


def bench_us(fn: Callable) -> float:
    """``do_bench``'s median in microseconds (10 ms of warm-up, 100 ms of calls, the L2 flushed before each);
    on CPU one call's wall clock."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


#: Kernel time one graph holds at most (the calls are made fewer for long kernels: 16k prefill takes 4-7 ms a call).
GRAPH_REPLAY_BUDGET_US = 50_000


def graph_us(fn: Callable, flush_by: str, us_hint: float | None = None) -> float | None:
    """:func:`graph_cold_us` on a GPU; None on CPU (no graphs there). ``us_hint`` (the call's ``do_bench`` time)
    caps the captured calls at :data:`GRAPH_REPLAY_BUDGET_US` of work, 3 to 20 of them."""
    if not torch.cuda.is_available():
        return None
    calls = 20 if not us_hint else max(3, min(20, int(GRAPH_REPLAY_BUDGET_US // us_hint)))
    return graph_cold_us(fn, calls=calls, flush_by=flush_by)


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Every sequence's first ``length`` cached tokens, gathered through its block table: ``[seqs, kv_heads, length, head]``."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[tables.long()[:, pos // block_size], pos % block_size].transpose(1, 2).contiguous()


def bottom_right_causal(new: int, total: int, device) -> torch.Tensor:
    """``[new, total]`` bool: query j sits at position ``total - new + j`` and sees the keys up to it."""
    return torch.arange(total, device=device)[None, :] <= torch.arange(total - new, total, device=device)[:, None]


@dataclasses.dataclass
class Problem:
    """One case's data in SDPA's layout (``[seqs, heads, tokens, head]``, K/V not expanded), with a float32 reference
    of the sampled sequences and heads."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seqs: list[int]
    heads: list[int]
    reference: torch.Tensor

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Problem:
        seqs = sorted({0, q.shape[0] - 1})
        # query heads of the first, a middle and the last KV head
        heads = sorted({0, HEADS // 2 + 1, HEADS - 1} & set(range(HEADS)))
        group = HEADS // KV_HEADS
        mask = bottom_right_causal(q.shape[2], k.shape[2], q.device)
        ref = []
        with sdpa_kernel(SDPBackend.MATH):  # one head at a time: a 16k x 16k float32 score matrix is 1 GiB
            for h in heads:
                kv = slice(h // group, h // group + 1)
                ref.append(
                    F.scaled_dot_product_attention(
                        q[seqs, h : h + 1].float(),
                        k[seqs, kv].float(),
                        v[seqs, kv].float(),
                        attn_mask=mask,
                        scale=HEAD**-0.5,
                    )
                )
        return cls(q, k, v, seqs, heads, torch.cat(ref, dim=1))

    def check(self, out: torch.Tensor) -> dict:
        """``out`` (``[seqs, heads, tokens, head]``) against the reference, within the op's bfloat16 tolerance."""
        tol = PAGED_ATTENTION_OP.tolerances[DTYPE]
        got = out[self.seqs][:, self.heads].float()
        err = (got - self.reference).abs()
        ok = bool((err <= tol.atol + tol.rtol * self.reference.abs()).all()) and bool(got.isfinite().all())
        return {"check": "ok" if ok else "WRONG", "max_err": float(err.max())}


def sdpa_call(backend: SDPBackend, q, k, v, **kwargs) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, scale=HEAD**-0.5, **kwargs)

    return run


def peer(backend: SDPBackend, problem: Problem, formulations: dict[str, dict], q, k, v, graph: bool) -> dict:
    """A peer's fastest formulation among those it accepts and that give the reference's values.

    A formulation the backend refuses (no kernel for a mask, a shape: torch's warnings say why) or that
    computes something else (``is_causal`` with fewer queries than keys is top-left aligned in torch's
    documentation) is recorded with the reason, and the next is tried; "n/a" with every reason when none serves.
    """
    tried: dict = {}
    best: dict | None = None
    for name, kwargs in formulations.items():
        run = sdpa_call(backend, q, k, v, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                verdict = problem.check(run())
                us = bench_us(run) if verdict["check"] == "ok" else None
            except Exception as e:
                tried[name] = "refused: " + why(e, caught)
                continue
        if us is None:
            tried[name] = f"wrong values (max error {verdict['max_err']:.3g})"
            continue
        tried[name] = us
        if best is None or us < best["us"]:
            best = {"us": us, "formulation": name, **verdict}
    if best is None:
        return {"error": "n/a: " + "; ".join(f"{n}: {r}" for n, r in tried.items()), "tried": tried}
    if graph:
        try:
            run = sdpa_call(backend, q, k, v, **formulations[best["formulation"]])
            best["graph_read_us"] = graph_us(run, "read", best["us"])
        except Exception as e:
            best["graph_error"] = why(e)
    return {**best, "tried": tried}


def attempt(what: str, row: dict, fn: Callable, *args) -> bool:
    """``fn(*args)``, one step of a case; a failure is printed and recorded in ``row``, and the case goes on."""
    try:
        fn(*args)
        return True
    except Exception as e:
        row["error"] = why(e)
        print(f"  {what}: ERROR {row['error']}", flush=True)
        return False


def prefill_data(case: PrefillCase, block_size: int, device: str, data: dict) -> None:
    """Fill ``data``: the op's arguments, the queries in SDPA's layout and the checked :class:`Problem`."""
    total = case.prefix + case.new
    data["args"], data["flops"] = prefill(case.new, block_size, device, case.seqs, case.prefix)
    q, k_cache, v_cache, tables = data["args"][:4]
    data["q"] = q.view(case.seqs, case.new, HEADS, HEAD).transpose(1, 2)  # [seqs, heads, new, head]
    data["problem"] = Problem.of(
        data["q"], contiguous_kv(k_cache, tables, total), contiguous_kv(v_cache, tables, total)
    )


def prefill_ours(case: PrefillCase, provider, data: dict, row: dict) -> None:
    """Check, then time with ``do_bench`` (host launch included) and as a graph replay (the kernel alone, read flush):
    the gap between the two is what the host's launch costs. A failed capture is noted; the row stands."""
    run = lambda: provider.fn(*data["args"])  # noqa: E731
    row.update(data["problem"].check(run().view(case.seqs, case.new, HEADS, HEAD).transpose(1, 2)))
    row["us"] = bench_us(run)
    try:
        row["graph_read_us"] = graph_us(run, "read", row["us"])
    except Exception as e:
        row["graph_error"] = why(e)
    graph = _graph_shown(row.get("graph_read_us"), "9.1f")
    print(f"prefill {case.label:20s} block {row['block_size']:<3} ours  {row['us']:9.1f} us "
          f"{data['flops'] / row['us'] / 1e6:6.1f} TFLOP/s  graph_read {graph}  check {row['check']} "
          f"(max err {row['max_err']:.2g})", flush=True)  # fmt: skip


def prefill_peers(case: PrefillCase, peers: dict, data: dict, result: dict) -> None:
    """The peers on our data, K/V contiguous and GQA expanded (as the earlier runs had them)."""
    formulations = {"is_causal": {"is_causal": True}}
    if case.prefix:  # fewer queries than keys: the causal diagonal must end at the bottom-right corner
        formulations["causal_lower_right"] = {"attn_mask": causal_lower_right(case.new, case.prefix + case.new)}
    problem, group = data["problem"], HEADS // KV_HEADS
    q, k, v = data["q"].contiguous(), problem.k.repeat_interleave(group, 1), problem.v.repeat_interleave(group, 1)
    for name, backend in peers.items():
        result["peers"][name] = found = peer(backend, problem, formulations, q, k, v, graph=True)
        graph = _graph_shown(found.get("graph_read_us"), "9.1f")
        shown = (f"{found['us']:9.1f} us {data['flops'] / found['us'] / 1e6:6.1f} TFLOP/s  graph_read {graph}  "
                 f"as {found['formulation']}" if "us" in found else found["error"])  # fmt: skip
        print(f"prefill {case.label:20s}           {name:5s} {shown}", flush=True)


def decode_data(case: DecodeCase, block_size: int, device: str, data: dict) -> None:
    data["args"], data["bytes"] = decode(case.seqs, case.context, device, block_size)
    q, k_cache, v_cache, tables = data["args"][:4]
    data["q"] = q[:, :, None]  # [seqs, heads, 1, head]
    k, v = contiguous_kv(k_cache, tables, case.context), contiguous_kv(v_cache, tables, case.context)
    data["problem"] = Problem.of(data["q"], k, v)


def decode_ours(case: DecodeCase, provider, data: dict, row: dict) -> None:
    run = lambda: provider.fn(*data["args"])  # noqa: E731
    row.update(data["problem"].check(run()[:, :, None]))
    row["do_bench_us"] = bench_us(run)
    row["graph_read_us"] = graph_us(run, "read")
    row["graph_write_us"] = graph_us(run, "write")
    times = {"do_bench": _f(row["do_bench_us"], ".1f", " us")}
    times.update({how: _graph_shown(row[f"{how}_us"]) for how in ("graph_read", "graph_write")})
    shown = "  ".join(f"{how} {took}" for how, took in times.items())
    print(f"decode  {case.label:20s} block {row['block_size']:<3} ours  {shown}  check {row['check']} "
          f"(max err {row['max_err']:.2g})", flush=True)  # fmt: skip


def decode_peers(case: DecodeCase, peers: dict, data: dict, result: dict) -> None:
    """The peers on our data, K/V contiguous, GQA native (expanded K/V would be 4x the bytes)."""
    problem, q = data["problem"], data["q"].contiguous()
    for name, backend in peers.items():
        found = peer(backend, problem, {"enable_gqa": {"enable_gqa": True}}, q, problem.k, problem.v, graph=True)
        result["peers"][name] = found
        shown = (f"do_bench {found['us']:.1f} us  graph_read {_graph_shown(found.get('graph_read_us'))}"
                 if "us" in found else found["error"])  # fmt: skip
        print(f"decode  {case.label:20s}           {name:5s} {shown}", flush=True)


def run_case_rows(case: PrefillCase | DecodeCase, provider, peers: dict, device: str) -> dict:
    """Our kernel on each of the case's block sizes (built, checked, timed), then the peers on the first block size's
    data: last, so that a peer that breaks the process (a failed graph capture) costs none of our rows."""
    prefill_case = isinstance(case, PrefillCase)
    build, ours, theirs = (
        (prefill_data, prefill_ours, prefill_peers) if prefill_case else (decode_data, decode_ours, decode_peers)
    )
    kind = "prefill" if prefill_case else "decode"
    result: dict = {"kind": kind, "case": case.label, "shape": dataclasses.asdict(case), "ours": [], "peers": {}}
    first: dict | None = None
    for block_size in case.block_sizes:
        row, data = {"block_size": block_size}, {}
        result["ours"].append(row)
        where = f"{kind} {case.label} block {block_size}"
        if attempt(where, row, build, case, block_size, device, data):
            result["flops" if prefill_case else "bytes"] = data["flops" if prefill_case else "bytes"]
            attempt(where, row, ours, case, provider, data, row)
            first = first or data
        if first is not data:
            del data
            if device == "cuda":
                torch.cuda.empty_cache()
    if first is not None:
        attempt(f"{kind} {case.label} peers", result, theirs, case, peers, first, result)
    return result


def run_case(index: int, smoke: bool) -> dict:
    """Measure one case of the table (in this process)."""
    case = (SMOKE_CASES if smoke else SHIPPED_CASES)[index]
    device = "cpu" if smoke else "cuda"
    providers = shipped_providers()
    peers = SMOKE_PEERS if smoke else PEERS
    op = "prefill_attention" if isinstance(case, PrefillCase) else "paged_attention"
    return run_case_rows(case, providers[op], peers, device)


def case_failed(case: PrefillCase | DecodeCase, reason: str) -> dict:
    kind = "prefill" if isinstance(case, PrefillCase) else "decode"
    return {"kind": kind, "case": case.label, "ours": [{"block_size": b, "error": reason} for b in case.block_sizes],
            "peers": {}}  # fmt: skip


def run_case_isolated(index: int, smoke: bool) -> dict:
    """Measure one case in a process of its own: a kernel that faults (a sticky CUDA error) or hangs loses that case only."""
    case = (SMOKE_CASES if smoke else SHIPPED_CASES)[index]
    with tempfile.TemporaryDirectory() as tmp:
        rows_to = os.path.join(tmp, "case.json")
        command = [sys.executable, os.path.abspath(__file__), "--case", str(index), "--rows-to", rows_to]
        try:
            done = subprocess.run(command + (["--smoke"] if smoke else []), timeout=CASE_TIMEOUT_S)  # noqa: S603 - this script
        except subprocess.TimeoutExpired:
            print(f"  {case.label}: ERROR timed out after {CASE_TIMEOUT_S} s", flush=True)
            return case_failed(case, f"timed out after {CASE_TIMEOUT_S} s")
        if done.returncode != 0 or not os.path.exists(rows_to):
            how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
            print(f"  {case.label}: ERROR its process ended with {how}", flush=True)
            return case_failed(case, f"the case's process ended with {how} (its output is above)")
        with open(rows_to) as f:
            return json.load(f)


def ratio(peer_us: float | None, ours_us: float | None) -> float | None:
    """Our speed as a fraction of the peer's (its time over ours)."""
    return peer_us / ours_us if peer_us and ours_us else None


def judged(value: float | None, goal: float | None) -> str:
    if goal is None:
        return "-"
    if value is None:
        return "n/a"
    return "met" if value >= goal else "MISSED"


def table_rows(results: list[dict], copy_gbs: float, cases) -> tuple[list[dict], list[dict]]:
    """Flat rows with ratios and verdicts, one per case and block size (the peers' numbers repeat on each)."""
    goals = {c.label: c for c in cases}
    prefill_rows, decode_rows = [], []
    for res in results:
        case, peers = goals[res["case"]], dict(res.get("peers", {}))
        for name in PEERS:  # the peers' step failed as a whole: say why in their notes
            if name not in peers and "error" in res:
                peers[name] = {"error": f"not run: {res['error']}"}
        for ours in res["ours"]:
            check = "error" if "error" in ours else ours.get("check", "error")  # a step after the check failed
            row = {"case": res["case"], "block_size": ours["block_size"], "check": check}
            row.update({k: ours[k] for k in ("max_err", "error", "graph_error") if k in ours})
            if res["kind"] == "prefill":
                us, graph, flops = ours.get("us"), ours.get("graph_read_us"), res.get("flops")
                row.update(us=us, tflops=flops / us / 1e6 if us and flops else None)
                row.update(graph_read_us=graph, graph_read_tflops=flops / graph / 1e6 if graph and flops else None)
                for name in PEERS:
                    found = peers.get(name, {})
                    row.update({f"{name}_us": found.get("us"), f"vs_{name}": ratio(found.get("us"), us)})
                    row[f"{name}_graph_read_us"] = found.get("graph_read_us")
                    row[f"vs_{name}_graph"] = ratio(found.get("graph_read_us"), graph)
                    row[f"{name}_note"] = peer_note(found)
                row.update(cudnn_goal=case.cudnn_goal, cudnn_verdict=judged(row["vs_cudnn"], case.cudnn_goal))
                row.update(flash_goal=FLASH_GOAL, flash_verdict=judged(row["vs_flash"], FLASH_GOAL))
                prefill_rows.append(row)
            else:
                nbytes = res.get("bytes")
                for how in ("do_bench", "graph_read", "graph_write"):
                    us = ours.get(f"{how}_us")
                    row[f"{how}_us"] = us
                    row[f"{how}_gbs"] = nbytes / us / 1e3 if us and nbytes else None
                    row[f"{how}_of_copy"] = row[f"{how}_gbs"] / copy_gbs if row[f"{how}_gbs"] else None
                for name in PEERS:
                    found = peers.get(name, {})
                    row.update({f"{name}_us": found.get("us"), f"{name}_graph_read_us": found.get("graph_read_us")})
                    row[f"vs_{name}"] = ratio(found.get("graph_read_us"), row["graph_read_us"])
                    row[f"{name}_note"] = peer_note(found)
                row.update(copy_goal=case.copy_goal, copy_verdict=judged(row["graph_read_of_copy"], case.copy_goal))
                decode_rows.append(row)
    return prefill_rows, decode_rows


def _f(value: float | None, fmt: str, unit: str = "") -> str:
    return format(value, fmt) + unit if value is not None else "n/a"


def _graph_shown(us: float | None, fmt: str = ".1f") -> str:
    """A graph replay's time for a progress line: "-" on CPU (no graph tried), "n/a" where one failed."""
    return _f(us, fmt, " us") if torch.cuda.is_available() else "-"


def peer_note(found: dict) -> str:
    """How a peer ran (its SDPA formulation), and why the other formulations did not serve; or why it did not run."""
    if not found:
        return "not run (see the case's error)"
    if "us" not in found:
        return found["error"]
    others = [f"{name}: {reason}" for name, reason in found.get("tried", {}).items() if isinstance(reason, str)]
    note = f"ran as {found['formulation']}"
    if "graph_error" in found:
        note += f" (graph timing failed: {found['graph_error']})"
    return note + ("; not as " + "; ".join(others) if others else "")


def print_tables(prefill_rows: list[dict], decode_rows: list[dict], copy_gbs: float, graphs: bool = True) -> None:
    """Both tables as Markdown, then how each peer ran and every error. ``graphs=False`` (CPU): no graph was
    timed, and the graph columns say "-" (not "n/a", which means a graph was tried and failed)."""
    graph_cell = _f if graphs else lambda value, fmt, unit="": "-"
    print("\n## Prefill, causal: ours on paged K/V (scattered blocks), peers on contiguous K/V (GQA expanded); "
          "do_bench and graph replay (read flush)\n")  # fmt: skip
    print("| case | blocks | ours | TFLOP/s | cuDNN | flash | vs cuDNN | vs flash | ours graph, read flush "
          "| cuDNN graph, read flush | flash graph, read flush | graph vs cuDNN | graph vs flash "
          "| >= 0.9x cuDNN (8k, 16k) | >= 1.0x flash | check |")  # fmt: skip
    print(
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"
    )
    for r in prefill_rows:
        graph_cells = [graph_cell(r[f"{who}graph_read_us"], ",.1f", " us") for who in ("", "cudnn_", "flash_")]
        graph_cells += [graph_cell(r[f"vs_{name}_graph"], ".2f", "x") for name in PEERS]
        print(f"| {r['case']} | {r['block_size']} | {_f(r['us'], ',.1f', ' us')} | {_f(r['tflops'], '.0f')} "
              f"| {_f(r['cudnn_us'], ',.1f', ' us')} | {_f(r['flash_us'], ',.1f', ' us')} "
              f"| {_f(r['vs_cudnn'], '.2f', 'x')} | {_f(r['vs_flash'], '.2f', 'x')} | {' | '.join(graph_cells)} "
              f"| {r['cudnn_verdict']} | {r['flash_verdict']} | {r['check']} |")  # fmt: skip
    print(
        f"\n## Decode: GB/s count K/V read once, of copy: of {copy_gbs:,.0f} GB/s; peers on contiguous K/V, enable_gqa\n"
    )
    print("| case | blocks | do_bench | of copy | graph, read flush | of copy | graph, write flush | of copy "
          "| cuDNN graph | flash graph | vs cuDNN | vs flash | >= 80% of copy (graph, read) | check |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in decode_rows:
        cells = [(_f if how == "do_bench" else graph_cell)(r[f"{how}_{what}"], fmt, unit)
                 for how in ("do_bench", "graph_read", "graph_write")
                 for what, fmt, unit in (("us", ",.1f", " us"), ("of_copy", ".1%", ""))]  # fmt: skip
        cells += [graph_cell(r[f"{name}_graph_read_us"], ",.1f", " us") for name in PEERS]
        cells += [graph_cell(r[f"vs_{name}"], ".2f", "x") for name in PEERS]
        print(f"| {r['case']} | {r['block_size']} | {' | '.join(cells)} | {r['copy_verdict']} | {r['check']} |")
    print("\nvs: our speed as a fraction of the peer's (its time over ours). Prefill: vs compares do_bench times "
          "(host launch included; the verdicts judge these), graph vs compares graph replays (the kernels alone); "
          "decode compares graph replays (read flush).")  # fmt: skip
    print("How the peers ran (the SDPA formulation, or why not), and errors:")
    notes: dict[str, str] = {}
    for kind, rows in (("prefill", prefill_rows), ("decode", decode_rows)):
        for r in rows:
            for name in PEERS:
                notes.setdefault(f"{kind} {r['case']}, {name}", r[f"{name}_note"])
            if r.get("graph_error"):
                notes[f"{kind} {r['case']}, ours on {r['block_size']}-token blocks, graph"] = (
                    "graph timing failed: " + r["graph_error"]
                )
            if r.get("error"):
                notes[f"{kind} {r['case']}, ours on {r['block_size']}-token blocks"] = "ERROR " + r["error"]
            elif r["check"] != "ok":
                notes[f"{kind} {r['case']}, ours on {r['block_size']}-token blocks"] = (
                    f"WRONG, max error {r['max_err']:.3g}"
                )
    for what, note in notes.items():
        print(f"- {what}: {note}")


def shipped(smoke: bool, isolate: bool, json_path: str | None) -> int:
    """Issue 17's table: every case, then the tables with ratios and verdicts. 1 when one of our rows failed or was
    wrong."""
    cases = SMOKE_CASES if smoke else SHIPPED_CASES
    device = "cpu" if smoke else "cuda"
    copy_gbs = copy_bandwidth_gbs(torch.device(device), 1 << 30) if not smoke else 1.0
    if not smoke:
        torch.cuda.empty_cache()  # the cases run in other processes: leave them the memory
    names = {op: provider_label(p) for op, p in shipped_providers().items()}
    header = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "copy_gbs": copy_gbs, "providers": names}  # fmt: skip
    print(" | ".join(f"{k} {v}" for k, v in header.items()), flush=True)
    results, began = [], time.perf_counter()
    for index, case in enumerate(cases):
        case_began = time.perf_counter()
        if isolate:
            results.append(run_case_isolated(index, smoke))
        else:
            try:
                results.append(run_case(index, smoke))
            except Exception as e:
                print(f"  {case.label}: ERROR {why(e)}", flush=True)
                results.append(case_failed(case, why(e)))
        print(f"  ({case.label}: {time.perf_counter() - case_began:.0f} s)", flush=True)
        prefill_rows, decode_rows = table_rows(results, copy_gbs, cases)
        if json_path:  # after every case: a run cut short keeps what it measured
            with open(json_path, "w") as f:
                json.dump({**header, "prefill": prefill_rows, "decode": decode_rows, "cases": results}, f, indent=1)
    print_tables(prefill_rows, decode_rows, copy_gbs, graphs=not smoke)
    print(f"\n{len(cases)} cases in {time.perf_counter() - began:.0f} s")
    # a peer that refuses a shape is a finding (its row says n/a and why); our kernel failing or wrong is not
    return 1 if any(r["check"] != "ok" for r in prefill_rows + decode_rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few prefill tiles, not the whole grid")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on CPU (Triton's interpreter): test the script"
    )
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument(
        "--shipped", action="store_true", help="issue 17's table: the shipped CUDA kernels beside their peers"
    )
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="--shipped: each case in its own process (default on a GPU; off with --smoke)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # one case of --shipped (a child)
    parser.add_argument("--rows-to", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global BASE, HEADS, KV_HEADS
    if args.smoke:  # few heads keep the interpreter fast; GQA groups of 2 still
        HEADS, KV_HEADS = 4, 2
    if args.case is not None:
        result = run_case(args.case, args.smoke)
        with open(args.rows_to, "w") as f:
            json.dump(result, f)
        return 0
    if args.shipped:
        return shipped(args.smoke, not args.smoke if args.isolate is None else args.isolate, args.json)
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
