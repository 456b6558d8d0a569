"""Probe the remaining attention misses of issue 17 on one H200, in one run of about 3 minutes.

    python3 dev/experiments/probe_hopper.py [--json FILE] [--sections launch,prefill,decode]

- ``launch``: where the host's time goes when prefill and decode are launched eagerly (the engine launches
  prefill so): microseconds per call with the device never waited for, split into the op's input checks,
  the TMA descriptors and the rest (Triton's launcher), and a ``cProfile`` of the calls.
- ``prefill``: one causal sequence of 1k-16k tokens on 128-token blocks (TMA): both launch orders
  (``TritonTarget.prefill_order``) with the 128 x 128 x 8-warp tiles, the 128 x 64 x 4-warp tiles that let two
  programs share an SM (a natural overlap of one program's softmax with the other's MMAs; shipped) and the
  64 x 64 x 4-warp tiles (two programs an SM without register spills, ``dev/sm90_stats.py``), each by
  ``do_bench`` (L2 flushed, host launch included) and by graph replay (L2 flushed by reading, the flush
  subtracted), beside cuDNN and flash through torch's SDPA timed the same ways.
- ``gluon`` (not in the default sections): a Gluon kernel (``--gluon``): ``tma`` (``dev/experiments/gluon_prefill.py``,
  FlashAttention-3's intra-warpgroup overlap), ``ws_pp`` (the CUDA plugin's Hopper prefill: the same
  warp-specialised, a TMA producer warp and two consumer warpgroups taking turns) and ``ws`` (without the turns),
  checked by the op's contract on NaN-poisoned caches (ragged ends, prefixes), then timed beside the Triton kernel
  and cuDNN the same two ways. Run each in its own process under a timeout.
- ``decode``: 1 x 32k and 8 x 8k on 128-token blocks: the split rule's fewest tiles a split (8, shipped; 4) and
  a fixed 64 splits, by graph replay (read flush), beside cuDNN's decode and a device copy of the K/V bytes. (The
  first run swept 24-132 splits and four tile shapes: ``docs/results/h200/probe-hopper-h200-run1.txt``.)

Every variant's output is compared with torch's math SDPA in float32 on the same data before it is timed.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dev/: tune_attention
from tune_attention import HEAD, HEADS, KV_HEADS, decode, graph_cold_us, prefill

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.kernels.triton import attention as attention_module
from vllm_port.kernels.triton.attention import AttentionKernels
from vllm_port.ops import Provider
from vllm_port.ops.attention import check_prefill_attention
from vllm_port_cuda.ops import target_for, visible_capabilities

TARGET = target_for(visible_capabilities())
ROWS: list[dict] = []


def row(**fields) -> None:
    ROWS.append(fields)
    print("  ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()), flush=True)


def do_bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3


def reference_prefill(args) -> torch.Tensor:
    """Math SDPA in float32 on the first sequence's contiguous K/V (one sequence per case here)."""
    q, kc, vc, tables, _cu, lens, _n, scale = args
    length = int(lens[0])
    blocks = tables[0, : triton.cdiv(length, kc.shape[1])].long()
    k = kc[blocks].flatten(0, 1)[:length].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    v = vc[blocks].flatten(0, 1)[:length].float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, is_causal=True, scale=scale).transpose(
            0, 1
        )


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((out.float() - ref).abs() <= 2e-2 + 2e-2 * ref.abs()).all())  # bf16 output and probabilities


# ------------------------------------------------------------------------------------------------


def probe_launch() -> None:
    print("== launch: host microseconds per eager call (no device wait)", flush=True)
    from vllm_port_cuda.ops import hopper_providers

    kernels = AttentionKernels(TARGET)
    prefill_128, prefill_16 = prefill(1024, 128, "cuda")[0], prefill(1024, 16, "cuda")[0]
    hopper = hopper_providers([torch.cuda.get_device_capability()], [Provider("prefill_attention", "triton",
                              kernels.prefill_attention)])  # fmt: skip
    cases = {
        "prefill 1k block128 (Triton, TMA)": (kernels.prefill_attention, prefill_128, "prefill_attention"),
        "prefill 1k block16 (Triton, gather)": (kernels.prefill_attention, prefill_16, "prefill_attention"),
        "decode 1x32k block128 (TMA)": (kernels.paged_attention, decode(1, 32768, "cuda", 128)[0], "paged_attention"),
        "decode 1x32k block16 (gather)": (kernels.paged_attention, decode(1, 32768, "cuda", 16)[0], "paged_attention"),
    }
    if hopper:  # the CUDA plugin's provider on sm_90: checks, scope, Gluon descriptors and launch
        cases["prefill 1k block128 (Hopper provider)"] = (hopper[0].fn, prefill_128, "prefill_attention")
        cases["prefill 1k block16 (Hopper provider)"] = (hopper[0].fn, prefill_16, "prefill_attention")
    block_n = {  # the key tile each op's descriptors are built for, as its launcher chooses it
        "prefill_attention": attention_module._tiles(TARGET, HEAD, 2)[1],
        "paged_attention": attention_module._tiles(TARGET, HEAD, 2, decode=True)[1],
    }
    for label, (fn, args, op) in cases.items():
        for _ in range(10):
            fn(*args)
        torch.cuda.synchronize()
        calls = 200
        begin = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        host_us = (time.perf_counter() - begin) / calls * 1e6
        torch.cuda.synchronize()
        parts = {}
        if op == "prefill_attention":
            begin = time.perf_counter()
            for _ in range(calls):
                check_prefill_attention(*args)
            parts["checks_us"] = (time.perf_counter() - begin) / calls * 1e6
        begin = time.perf_counter()
        for _ in range(calls):
            attention_module._kv_descriptors(args[1], args[2], block_n[op])
        parts["descriptors_us"] = (time.perf_counter() - begin) / calls * 1e6
        row(section="launch", case=label, host_us=host_us, **parts)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(100):
            fn(*args)
        profile.disable()
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()), flush=True)
    for label in [label for label in cases if label.startswith("prefill 1k block128")] * 2:  # do_bench, alternated
        fn, args, _ = cases[label]
        row(section="launch", case=label, do_bench_us=do_bench_us(lambda fn=fn, args=args: fn(*args)))


# ------------------------------------------------------------------------------------------------

PREFILL_VARIANTS = {
    f"{order} {label}": {"prefill_order": order, **tiles}
    for label, tiles in (
        ("m128 n128 w8 s3", {}),
        ("m128 n64 w4 s2", {"attn_block_n": 64, "attn_warps": 4, "attn_stages": 2}),
        # two programs an SM without spilling (dev/sm90_stats.py): not measured yet
        ("m64 n64 w4 s2", {"attn_block_m": 64, "attn_block_n": 64, "attn_warps": 4, "attn_stages": 2}),
    )
    for order in ("head", "all_heads")
}


def sdpa_prefill(q: torch.Tensor, backend: SDPBackend):
    qs = q.transpose(0, 1)[None].contiguous()
    ks = torch.randn(1, KV_HEADS, q.shape[0], HEAD, device="cuda", dtype=q.dtype)
    vs = torch.randn_like(ks)
    ks, vs = ks.repeat_interleave(HEADS // KV_HEADS, 1), vs.repeat_interleave(HEADS // KV_HEADS, 1)

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    return run


def probe_prefill(lengths: list[int]) -> None:
    print("== prefill: one causal sequence, 128-token blocks, TFLOP/s of the causal half", flush=True)
    for tokens in lengths:
        args, flops = prefill(tokens, 128, "cuda")
        ref = reference_prefill(args) if tokens <= 8192 else None
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            fn = sdpa_prefill(args[0], backend)
            cold, graph = do_bench_us(fn), graph_cold_us(fn)
            row(
                section="prefill", tokens=tokens, variant=name, cold_us=cold, graph_us=graph, tflops=flops / graph / 1e6
            )
        for name, fields in PREFILL_VARIANTS.items():
            kernels = AttentionKernels(dataclasses.replace(TARGET, **fields))
            fn = lambda k=kernels, a=args: k.prefill_attention(*a)  # noqa: E731
            try:
                out = fn()
                ok = True if ref is None else close(out, ref)
                if not ok:
                    row(section="prefill", tokens=tokens, variant=name, error="wrong values")
                    continue
                cold, graph = do_bench_us(fn), graph_cold_us(fn)
            except Exception as e:  # a variant that does not compile is reported, not fatal
                row(section="prefill", tokens=tokens, variant=name, error=f"{type(e).__name__}: {str(e)[:120]}")
                continue
            tflops = {"tflops": flops / graph / 1e6, "cold_tflops": flops / cold / 1e6}
            row(section="prefill", tokens=tokens, variant=name, cold_us=cold, graph_us=graph, **tflops)


# ------------------------------------------------------------------------------------------------

DECODE_TILES = {"shipped (8 tiles a split)": {}, "4 tiles a split": {"decode_min_tiles_per_split": 4}}
SPLITS = (None, 64)


def probe_decode(copy_gbs: float) -> None:
    print(f"== decode: graph replay after a read flush, of copy {copy_gbs:.0f} GB/s", flush=True)
    for seqs, context in ((1, 32768), (8, 8192)):
        args, nbytes = decode(seqs, context, "cuda", 128)
        q = args[0][:, :, None]  # [seqs, heads, 1, head]
        kc, vc, tables = args[1], args[2], args[3]
        blocks = tables.long()
        k = kc[blocks].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()  # [seqs, kv_heads, context, head]
        v = vc[blocks].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True, scale=args[5])[
                :, :, 0
            ]

        def cudnn(q=q, k=k, v=v, scale=args[5]):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=scale)

        us = graph_cold_us(cudnn)
        row(
            section="decode",
            case=f"{seqs}x{context}",
            variant="cudnn",
            graph_us=us,
            of_copy=nbytes / us / 1e3 / copy_gbs,
        )
        for name, fields in DECODE_TILES.items():
            kernels = AttentionKernels(dataclasses.replace(TARGET, **fields))
            for splits in SPLITS:
                fn = lambda k=kernels, s=splits, a=args: k._decode(*a, 0, 0.0, num_splits=s)  # noqa: E731
                try:
                    if not close(fn(), ref):
                        row(
                            section="decode",
                            case=f"{seqs}x{context}",
                            variant=name,
                            splits=splits,
                            error="wrong values",
                        )
                        continue
                    us = graph_cold_us(fn)
                except Exception as e:
                    row(section="decode", case=f"{seqs}x{context}", variant=name, splits=splits, error=str(e)[:120])
                    continue
                row(section="decode", case=f"{seqs}x{context}", variant=name, splits=splits or "auto", graph_us=us,
                    of_copy=nbytes / us / 1e3 / copy_gbs)  # fmt: skip


def _gluon_kernel(name: str) -> Callable[..., torch.Tensor]:
    """A Gluon kernel by name: ``tma`` (``dev/experiments/gluon_prefill.py``, the first experiment), ``ws_pp`` (the CUDA plugin's
    Hopper prefill, ``vllm_port_cuda.hopper_prefill``, as shipped) and ``ws`` (the same without the warpgroups'
    ping-pong)."""
    if name == "tma":
        import gluon_prefill

        return gluon_prefill.gluon_prefill
    if name not in ("ws", "ws_pp"):
        raise SystemExit(f"probe_hopper: unknown Gluon kernel {name!r}; pick tma, ws or ws_pp")
    from vllm_port_cuda import hopper_prefill

    def run(*args: object) -> torch.Tensor:
        if hopper_prefill.unsupported(*args[:3], *args[8:]):
            raise ValueError(f"hopper_prefill: {hopper_prefill.unsupported(*args[:3], *args[8:])}")
        return hopper_prefill.hopper_prefill_attention(*args[:8], pingpong=name == "ws_pp")

    return run


def probe_gluon(lengths: list[int], kernel: str = "tma") -> None:
    """A Gluon experiment: the op's own check first (NaN in unowned slots, ragged ends, prefixes), then timed."""
    from vllm_port.ops import prefill_attention as op
    from vllm_port.ops.attention import _paged_batch

    gluon_fn = _gluon_kernel(kernel)
    print(f"== gluon: the {kernel!r} kernel, checked by the op's contract, then beside the shipped kernel and cuDNN")
    gen = torch.Generator().manual_seed(0)
    for q_lens, prefixes in (([300], [0]), ([200, 77, 1], [77, 300, 500]), ([512] * 4, [512] * 4), ([1000], [0])):
        lens = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
        kc, vc, tables, seq_lens = _paged_batch(gen, torch.device("cuda"), torch.bfloat16, lens, KV_HEADS, HEAD, 128)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), HEADS, HEAD, generator=gen).to("cuda", torch.bfloat16)
        args = (q, kc, vc, tables, cu, seq_lens, max(q_lens), HEAD**-0.5, 0, 0.0)
        try:
            verdict = op.check(gluon_fn, args, torch.bfloat16) or "ok"
        except Exception as e:
            verdict = f"{type(e).__name__}: {str(e)[:200]}"
        row(section="gluon", kernel=kernel, case=f"check q {q_lens} after {prefixes}", check=verdict)
        if verdict != "ok":
            return  # a wrong kernel is not timed
    shipped = AttentionKernels(TARGET)
    for label, tokens, seqs, prefix in [(f"1 x {n}", n, 1, 0) for n in lengths] + [
        ("16 x 512 after 512", 512, 16, 512)
    ]:
        args, flops = prefill(tokens, 128, "cuda", seqs=seqs, prefix=prefix)
        times = {}
        for name, fn in (
            (f"gluon_{kernel}", lambda a=args: gluon_fn(*a)),
            ("triton", lambda a=args: shipped.prefill_attention(*a)),
        ):
            times[name] = (do_bench_us(fn), graph_cold_us(fn))
        if seqs == 1:
            cudnn = sdpa_prefill(args[0], SDPBackend.CUDNN_ATTENTION)
            times["cudnn"] = (do_bench_us(cudnn), graph_cold_us(cudnn))
        for name, (cold, graph) in times.items():
            row(section="gluon", case=label, variant=name, cold_us=cold, graph_us=graph, tflops=flops / graph / 1e6)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sections", default="launch,prefill,decode")
    parser.add_argument("--lengths", default="1024,4096,8192,16384")
    parser.add_argument(
        "--gluon", default="ws_pp", help="the Gluon kernel the gluon section runs: ws_pp (shipped), ws, tma"
    )
    opts = parser.parse_args()
    sections = set(opts.sections.split(","))
    print(
        f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, target {TARGET.name}"
    )
    copy_gbs = copy_bandwidth_gbs(torch.device("cuda"), 1 << 30)
    try:
        if "launch" in sections:
            probe_launch()
        if "prefill" in sections:
            probe_prefill([int(n) for n in opts.lengths.split(",")])
        if "decode" in sections:
            probe_decode(copy_gbs)
        if "gluon" in sections:  # its own call in dev/gpu-run, under a timeout: an untried kernel may hang
            probe_gluon([int(n) for n in opts.lengths.split(",")], opts.gluon)
    finally:
        if opts.json:
            Path(opts.json).write_text(json.dumps({"copy_gbs": copy_gbs, "rows": ROWS}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
