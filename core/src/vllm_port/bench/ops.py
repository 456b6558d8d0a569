"""``vllm-port bench ops``: every provider of every op against its peers, at Llama-3-8B shapes.

For each op and token count, one run times: each provider the selected platform has (the
reference included), the reference compiled by Inductor, and, for prefill attention, torch's
SDPA through cuDNN and through the flash path. Memory-bound ops are reported as achieved bandwidth against two ceilings measured
in the same run, a copy and a read-only stream (reads alone go faster than a copy); prefill
attention and linear as TFLOP/s against the measured matrix-product rate. Every row has two times:
``ms`` with warm caches (graph replays or batches of launches, as a decode step runs), and
``cold_ms`` with the caches flushed before each call.

``linear`` also runs Llama-3-8B's decode matrix-vector products (:data:`GEMV_SHAPES` at
:data:`GEMV_ROWS` rows; on a CPU only with ``--full``), reported as bandwidth over the weight's bytes
(all such a product must read); its ``reference`` peer is ``F.linear``, i.e. the vendor BLAS (cuBLAS
on NVIDIA). A decode step reads each weight once, so their cold column (with its fraction of the
copy bandwidth) is the one to judge them by: the ``o`` weight (32 MiB) fits in an H200's 50 MiB L2.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import vllm_port
from vllm_port.ops import make_cos_sin_cache

from ._timing import cold_median_ms, copy_bandwidth_gbs, graph_median_ms, matmul_tflops, median_ms, read_bandwidth_gbs

HIDDEN, HEADS, KV_HEADS, HEAD, INTER, VOCAB, BLOCK = 4096, 32, 8, 128, 14336, 128256, 16
CONTEXT = 4096  # decode attention: every sequence has this many cached tokens
TOKENS = {
    "elementwise": (1, 16, 256, 1024, 4096, 16384, 32768),
    "decode": (1, 16, 64, 256),
    "prefill": (1024, 4096, 8192, 16384),
    "linear": (1, 16, 256, 4096, 16384),
}
OP_TOKENS = {
    "embedding": "elementwise", "rms_norm": "elementwise", "fused_add_rms_norm": "elementwise",
    "rotary_embedding": "elementwise", "reshape_and_cache": "elementwise", "silu_and_mul": "elementwise",
    "gelu_and_mul": "elementwise", "linear": "linear", "paged_attention": "decode", "prefill_attention": "prefill",
    "sample": "decode",
}  # fmt: skip
#: The token counts a CPU run keeps unless ``--full``: every op at Llama-3-8B widths, in minutes and
#: within a few GB. All of TOKENS on a 2-core, 24 GB machine ran over 7 minutes without finishing and
#: held 15 GB at its peak (256 decode sequences of 4096 cached tokens are 8 GB of K/V alone).
CPU_TOKENS = {
    "elementwise": (1, 16, 256, 1024),
    "decode": (1, 16),
    "prefill": (256, 1024),
    "linear": (1, 16, 256),
}
COMPUTE_BOUND = {"linear", "prefill_attention"}
#: Llama-3-8B's projections as (out_features, in_features): at decode each is a matrix-vector product.
GEMV_SHAPES = {
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "lm_head": (128256, 4096),
}  # fmt: skip
#: Rows (tokens) the decode products are timed at: batch 1, and a small batch.
GEMV_ROWS = (1, 8)
#: Peers that read device values on the host, so no graph can capture them.
UNCAPTURABLE = {("paged_attention", "reference"), ("prefill_attention", "reference")}


@dataclass
class Workload:
    """One op call to time: its arguments and the fewest bytes it moves / FLOPs it does."""

    args: tuple[Any, ...]
    nbytes: int
    flops: int
    memory_bound: bool = False  # report bandwidth even for an op in COMPUTE_BOUND (a decode product)


def _paged(tokens: int, context: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    blocks_per_seq = math.ceil(context / BLOCK)
    num_blocks = tokens * blocks_per_seq
    cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD, device=device, dtype=dtype, generator=gen)
    tables = torch.randperm(num_blocks, device=device, generator=gen).view(tokens, blocks_per_seq).to(torch.int32)
    return cache, cache.clone(), tables


def workload(op: str, tokens: int, dtype: torch.dtype, device: torch.device) -> Workload:
    """Arguments for ``op`` at ``tokens`` tokens (sequences, for decode attention and sampling)."""
    gen = torch.Generator(device).manual_seed(tokens)
    size = torch.finfo(dtype).bits // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    if op == "embedding":
        ids = torch.randint(0, VOCAB, (tokens,), device=device, generator=gen)
        return Workload((ids, rand(VOCAB, HIDDEN)), 2 * tokens * HIDDEN * size, 0)
    if op == "rms_norm":
        return Workload((rand(tokens, HIDDEN), rand(HIDDEN), 1e-6), 2 * tokens * HIDDEN * size, 0)
    if op == "fused_add_rms_norm":
        return Workload((rand(tokens, HIDDEN), rand(tokens, HIDDEN), rand(HIDDEN), 1e-6), 4 * tokens * HIDDEN * size, 0)
    if op in ("silu_and_mul", "gelu_and_mul"):
        return Workload((rand(tokens, 2 * INTER),), 3 * tokens * INTER * size, 0)
    if op == "rotary_embedding":
        positions = torch.randint(0, 8192, (tokens,), device=device, generator=gen)
        q, k = rand(tokens, HEADS * HEAD), rand(tokens, KV_HEADS * HEAD)
        moved = 2 * tokens * (HEADS + KV_HEADS) * HEAD * size + tokens * HEAD * 4
        return Workload((positions, q, k, HEAD, make_cos_sin_cache(8192, HEAD).to(device), True), moved, 0)
    if op == "reshape_and_cache":
        cache_blocks = math.ceil(tokens / BLOCK) + 1
        slots = torch.randperm(cache_blocks * BLOCK, device=device, generator=gen)[:tokens]
        kc, vc = rand(cache_blocks, BLOCK, KV_HEADS, HEAD), rand(cache_blocks, BLOCK, KV_HEADS, HEAD)
        return Workload(
            (rand(tokens, KV_HEADS, HEAD), rand(tokens, KV_HEADS, HEAD), kc, vc, slots),
            4 * tokens * KV_HEADS * HEAD * size,
            0,
        )
    if op == "linear":
        out = 3 * HIDDEN // 2  # Llama-3-8B's fused QKV projection: 4096 -> 6144
        weight = rand(out, HIDDEN) / HIDDEN**0.5
        return Workload(
            (rand(tokens, HIDDEN), weight, None),
            (tokens * (HIDDEN + out) + out * HIDDEN) * size,
            2 * tokens * HIDDEN * out,
        )
    if op == "paged_attention":
        kc, vc, tables = _paged(tokens, CONTEXT, dtype, device, gen)
        lens = torch.full((tokens,), CONTEXT, device=device, dtype=torch.int32)
        moved = 2 * tokens * CONTEXT * KV_HEADS * HEAD * size + 2 * tokens * HEADS * HEAD * size
        return Workload(
            (rand(tokens, HEADS, HEAD), kc, vc, tables, lens, HEAD**-0.5), moved, 4 * tokens * CONTEXT * HEADS * HEAD
        )
    if op == "prefill_attention":
        kc, vc, tables = _paged(1, tokens, dtype, device, gen)
        cu = torch.tensor([0, tokens], device=device, dtype=torch.int32)
        lens = torch.tensor([tokens], device=device, dtype=torch.int32)
        flops = 4 * HEADS * HEAD * tokens * (tokens + 1) // 2  # QK^T and PV over the causal half
        return Workload((rand(tokens, HEADS, HEAD), kc, vc, tables, cu, lens, tokens, HEAD**-0.5), 0, flops)
    if op == "sample":
        logits = rand(tokens, VOCAB)
        temperature = torch.rand(tokens, device=device, generator=gen)
        top_k = torch.randint(0, 100, (tokens,), device=device, generator=gen, dtype=torch.int32)
        top_p = torch.rand(tokens, device=device, generator=gen) * 0.5 + 0.5
        seeds = torch.randint(0, 2**62, (tokens,), device=device, generator=gen)
        return Workload((logits, temperature, top_k, top_p, seeds), tokens * VOCAB * size, 0)
    raise ValueError(f"no benchmark workload for op {op!r}")


def gemv_workload(name: str, rows: int, dtype: torch.dtype, device: torch.device) -> Workload:
    """``linear`` of ``rows`` tokens through Llama-3-8B's ``name`` projection; the bytes are the weight's."""
    out_features, in_features = GEMV_SHAPES[name]
    gen = torch.Generator(device).manual_seed(rows)
    x = torch.randn(rows, in_features, device=device, dtype=dtype, generator=gen)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=gen) / in_features**0.5
    nbytes = out_features * in_features * weight.element_size()
    return Workload((x, weight, None), nbytes, 2 * rows * in_features * out_features, memory_bound=True)


#: torch's SDPA backends timed beside prefill attention, strongest first on Hopper (cuDNN's fused
#: attention), each skipped with its reason where the build or device lacks it.
SDPA_PEERS = {
    "torch sdpa cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION,
    "torch sdpa flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
}


def _sdpa(args: tuple[Any, ...], backend: torch.nn.attention.SDPBackend) -> Callable[..., Any]:
    """torch's SDPA through one backend on the same causal problem, with K/V laid out contiguously for it."""
    query, tokens = args[0], args[6]
    q = query.transpose(0, 1)[None]
    k = torch.randn(1, HEADS, tokens, HEAD, device=query.device, dtype=query.dtype)
    v = torch.randn_like(k)

    def run(*_: Any) -> torch.Tensor:  # takes (and ignores) the op's arguments, like the other peers
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return run


def _peers(runtime: vllm_port.Runtime, op: str, dtype: torch.dtype) -> dict[str, Callable[..., Any]]:
    ref = runtime.registry.ops[op].reference
    peers: dict[str, Callable[..., Any]] = {}
    for p in runtime.registry.candidates(op, runtime.platform.name):
        if p.is_supported(runtime.bind_context(dtype)):
            peers[p.name] = p.fn
    if op not in ("paged_attention", "prefill_attention"):  # the attention references loop over sequences in Python
        peers["reference (torch.compile)"] = torch.compile(ref, dynamic=False)
    return peers


def _time(
    op: str, name: str, fn: Callable[..., Any], args: tuple[Any, ...], runtime: vllm_port.Runtime
) -> tuple[float, str]:
    """Milliseconds per call and how they were measured: graph replays where the platform captures, else launches."""
    capture = runtime.graph_capture()
    if capture is not None and (op, name) not in UNCAPTURABLE:
        try:
            return graph_median_ms(lambda: fn(*args), capture, runtime.device), "graph replay"
        except Exception:  # noqa: S110 - a peer that cannot be captured is timed by its launches instead
            pass
    return median_ms(lambda: fn(*args), runtime.device), "launches"


def token_counts(op: str, device_type: str, max_tokens: int, full: bool = False) -> tuple[int, ...]:
    """The token counts ``op`` is timed at: TOKENS up to ``max_tokens``, and on a CPU only CPU_TOKENS unless ``full``."""
    family = OP_TOKENS[op]
    sizes = TOKENS[family] if full or device_type != "cpu" else CPU_TOKENS.get(family, TOKENS[family])
    return tuple(t for t in sizes if t <= max_tokens)


def cases(op: str, device_type: str, max_tokens: int, full: bool = False) -> list[tuple[int, str]]:
    """``(tokens, case)`` pairs ``op`` is timed at: its token counts (case ``""``), then for ``linear`` the
    decode products (case: a GEMV_SHAPES name), which a CPU runs only with ``full``."""
    found = [(tokens, "") for tokens in token_counts(op, device_type, max_tokens, full)]
    if op == "linear" and (full or device_type != "cpu"):
        found += [(rows, name) for rows in GEMV_ROWS if rows <= max_tokens for name in GEMV_SHAPES]
    return found


def run(
    device: str | None,
    dtype: torch.dtype,
    ops: list[str] | None,
    max_tokens: int,
    json_path: str | None = None,
    full: bool = False,
) -> dict[str, Any]:
    """Time every op's providers and peers; return the results as one JSON-ready object (written after each op).

    :param full: on a CPU, time every size of TOKENS rather than the bounded CPU_TOKENS.
    """
    runtime = vllm_port.load(device=device)
    dev = runtime.device
    chosen = ops or list(OP_TOKENS)
    plan = {op: cases(op, dev.type, max_tokens, full) for op in chosen}
    peers_of = {op: _peers(runtime, op, dtype) for op in chosen}
    planned = sum(
        len(plan[op]) * (len(peers_of[op]) + (len(SDPA_PEERS) if op == "prefill_attention" else 0)) for op in chosen
    )
    bounded = dev.type == "cpu" and not full
    print(
        f"planned: {planned} rows ({len(chosen)} ops){'; CPU sizes bounded, --full times every size' if bounded else ''}",
        flush=True,
    )
    done = 0
    result: dict[str, Any] = {
        "platform": runtime.platform.name,
        "device": runtime.selected.probe.devices[0].name if runtime.selected.probe else "?",
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "copy_gbs": copy_bandwidth_gbs(dev, 1 << 30 if dev.type != "cpu" else 1 << 27),
        "read_gbs": read_bandwidth_gbs(dev, 1 << 30 if dev.type != "cpu" else 1 << 27),
        "matmul_tflops": matmul_tflops(dev, 8192 if dev.type != "cpu" else 1024, dtype),
        "rows": [],
        "bounded": bounded,
    }
    for op in chosen:
        peers = peers_of[op]
        for tokens, case in plan[op]:
            work = gemv_workload(case, tokens, dtype, dev) if case else workload(op, tokens, dtype, dev)
            timed = dict(peers)
            if op == "prefill_attention":
                timed.update({name: _sdpa(work.args, backend) for name, backend in SDPA_PEERS.items()})
            for name, fn in timed.items():
                done += 1
                progress = f"[{done:>{len(str(planned))}}/{planned}] "
                try:
                    ms, timing = _time(op, name, fn, work.args, runtime)
                except Exception as exc:  # a peer that cannot run this case is reported, not fatal
                    row = {"op": op, "tokens": tokens, "impl": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
                    row.update({"case": case} if case else {})
                    result["rows"].append(row)
                    print(progress + _format_row(row), flush=True)
                    continue
                cold = cold_median_ms(lambda fn=fn, args=work.args: fn(*args), dev, repeat=25 if ms < 5 else 5)
                row = {"op": op, "tokens": tokens, "impl": name, "ms": ms, "timing": timing, "cold_ms": cold}
                row.update({"case": case} if case else {})
                if op in COMPUTE_BOUND and not work.memory_bound:
                    row["tflops"] = work.flops / ms / 1e9
                    row["fraction"] = row["tflops"] / result["matmul_tflops"]
                else:
                    row["gbs"] = work.nbytes / ms / 1e6
                    row["fraction"] = row["gbs"] / result["copy_gbs"]
                    row["fraction_of_read"] = row["gbs"] / result["read_gbs"]
                    row["cold_fraction"] = work.nbytes / cold / 1e6 / result["copy_gbs"]
                result["rows"].append(row)
                print(progress + _format_row(row), flush=True)
        if json_path:  # a run cut short still leaves every finished op on disk
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
    return result


def _label(row: dict[str, Any]) -> str:
    """The op, with the named shape of a case that has one (``linear/qkv``)."""
    return f"{row['op']}/{row['case']}" if row.get("case") else row["op"]


def _format_row(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{_label(row):<20}{row['tokens']:>7}  {row['impl']:<28} error: {row['error'][:80]}"
    rate = f"{row['tflops']:8.1f} TFLOP/s" if "tflops" in row else f"{row['gbs']:8.0f} GB/s   "
    of_read = f"{row['fraction_of_read']:7.1%}" if "fraction_of_read" in row else " " * 7
    cold_of_copy = f" {row['cold_fraction']:7.1%}" if "cold_fraction" in row else ""
    timing = f"{row['ms'] * 1e3:>11.1f} us {rate} {row['fraction']:7.1%} {of_read} {row['cold_ms'] * 1e3:>11.1f} us"
    return f"{_label(row):<20}{row['tokens']:>7}  {row['impl']:<28}{timing}{cold_of_copy}  ({row['timing']})"


PLOT_EXTRA_HINT = "--plot needs matplotlib: pip install 'vllm-port[plot]' (or pip install matplotlib)"


def plot(result: dict[str, Any], path: str) -> None:
    """One panel per op: fraction of the ceiling (copy bandwidth or matmul rate) against tokens, a line per implementation.

    :raises ImportError: naming the ``plot`` extra, when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(PLOT_EXTRA_HINT) from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(_label(r) for r in result["rows"]))
    cols = 3
    fig, axes = plt.subplots(
        math.ceil(len(ops) / cols), cols, figsize=(15, 4 * math.ceil(len(ops) / cols)), squeeze=False
    )
    for ax, op in zip(axes.flat, ops, strict=False):
        rows = [r for r in result["rows"] if _label(r) == op and "fraction" in r]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = [(r["tokens"], r["fraction"]) for r in rows if r["impl"] == impl]
            ax.plot(*zip(*points, strict=True), marker="o", label=impl)
        ceiling = "matmul rate" if any("tflops" in r for r in rows) else "copy bandwidth"
        ax.set(title=op, xscale="log", xlabel="tokens (sequences for decode/sample)", ylabel=f"fraction of {ceiling}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops) :]:
        ax.remove()
    fig.suptitle(
        f"vllm-port ops on {result['device']} ({result['dtype']}): copy {result['copy_gbs']:.0f} GB/s, matmul {result['matmul_tflops']:.0f} TFLOP/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(
    device: str | None,
    dtype_name: str,
    ops: str | None,
    max_tokens: int,
    json_path: str | None,
    plot_path: str | None,
    full: bool = False,
) -> int:
    """Run, print the table, and write the JSON and the plot when asked (exit 2 before any timing when the plot cannot be drawn)."""
    if plot_path and importlib.util.find_spec("matplotlib") is None:
        print(f"error: {PLOT_EXTRA_HINT}", file=sys.stderr)
        return 2
    dtype = getattr(torch, dtype_name)
    header = f"{'time':>14} {'rate':>15} {'of copy':>7} {'of read':>7} {'cold (L2 flushed)':>14} {'of copy':>7}"
    print(f"{'op':<20}{'tokens':>7}  {'implementation':<28}{header}")
    result = run(device, dtype, ops.split(",") if ops else None, max_tokens, json_path, full)
    print(
        f"ceilings on {result['device']}: copy {result['copy_gbs']:.0f} GB/s, read {result['read_gbs']:.0f} GB/s, "
        f"matmul {result['matmul_tflops']:.1f} TFLOP/s ({result['dtype']})"
    )
    if plot_path:
        plot(result, plot_path)
    return 0
