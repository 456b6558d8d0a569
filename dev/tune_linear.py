"""Sweep the CUDA target's knobs for the split-K ``linear`` kernel against cuBLAS, on the GPU.

    python3 dev/tune_linear.py [--rows 1,4,8,16] [--quick]

For Llama-3-8B's decode products (``vllm_port.bench.ops.GEMV_SHAPES``) at each row count, times
cuBLAS (``F.linear``) and the kernel under variants of its knobs as the engine runs them: replayed
from a CUDA graph, back to back over copies of the weight that together pass 256 MiB (each call
meets its weight cold, as a decode step meets each layer's; no flush between calls, since a step has
none). ``triton.testing.do_bench`` (L2 flushed, eager launches) is printed beside it in the summary:
at these sizes it adds the host's launch time of a Python launcher to the kernel's, which graphs do
not pay. The knobs are searched in groups, each group's winner kept for the next: tiles (BLOCK_N x
BLOCK_K) with every split rule (programs per SM to reach by splitting K; 0 never splits), then warps
x pipeline stages, then the split rule again. A variant is scored by a decode step's time: 32 layers
of qkv, o, gate_up and down, plus the lm_head.
Both paths are searched where they apply: one row on vector units (``fma``) or on tensor cores
(``dot``), more rows on tensor cores.
The summary prints every shape beside cuBLAS (also timed as CUDA-graph replays, flush included and
subtracted, which is how the engine launches) and the ``TritonTarget`` lines to paste.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

import vllm_port
from vllm_port.bench._timing import copy_bandwidth_gbs, graph_median_ms
from vllm_port.bench.ops import GEMV_SHAPES
from vllm_port.kernels.triton import LinearTiles, TritonTarget
from vllm_port.kernels.triton.linear import LinearKernels
from vllm_port_cuda.triton_targets import CUDA

#: How many times a decode step of Llama-3-8B runs each product.
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
TILES = [(16, 256), (16, 512), (32, 128), (32, 256), (32, 512), (64, 128), (64, 256), (128, 128)]
QUICK_TILES = [(16, 512), (32, 256), (64, 128)]
WARPS_STAGES = [(w, s) for w in (2, 4, 8) for s in (1, 2, 3, 4)]
QUICK_WARPS_STAGES = [(4, 2), (4, 3), (8, 3)]
WAVES = (0, 1, 2, 4, 8)
DEVICE = "cuda"
#: Bytes of weight copies a timed chain cycles through: five times an H200's 50 MiB L2.
CHAIN_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Variant:
    path: str  # "fma" (vector units) or "dot" (tensor cores)
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    waves: int = 4

    def target(self) -> TritonTarget:
        tiles = LinearTiles(self.block_n, self.block_k, self.warps, self.stages, self.waves)
        return dataclasses.replace(
            CUDA, linear_max_rows=16, linear_fma=tiles if self.path == "fma" else None, linear_dot=tiles
        )

    def __str__(self) -> str:
        return f"{self.path} n{self.block_n} k{self.block_k} w{self.warps} s{self.stages} waves{self.waves}"


def cold_us(fn) -> float:
    """Median microseconds of one call, the L2 flushed before each (triton's do_bench)."""
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def chain_us(fn, copies: int, capture, rounds: int = 4) -> float:
    """Microseconds of one call ``fn(i)`` as a CUDA graph replays ``rounds`` passes over ``copies`` weight copies
    (``capture`` warms the chain up outside the graph: the kernels compile, the split counts are allocated)."""
    chain = lambda: [fn(i) for i in range(copies)]  # noqa: E731
    return graph_median_ms(chain, capture, torch.device(DEVICE), calls=rounds, repeat=7) * 1e3 / copies


class Shapes:
    """Inputs for every shape at one row count, and the timing of a variant over them."""

    def __init__(self, rows: int, weights: dict[str, list[torch.Tensor]], capture) -> None:
        self.rows = rows
        self.weights = weights
        self.capture = capture
        gen = torch.Generator(DEVICE).manual_seed(rows)
        self.x = {
            name: torch.randn(rows, ws[0].shape[1], device=DEVICE, dtype=ws[0].dtype, generator=gen)
            for name, ws in weights.items()
        }
        self.ref = {name: F.linear(self.x[name], ws[0]) for name, ws in weights.items()}

    def time(self, linear) -> dict[str, float]:
        """Graph-replayed chain time of ``linear(x, w)`` per shape."""
        return {
            name: chain_us(lambda i, name=name, ws=ws: linear(self.x[name], ws[i]), len(ws), self.capture)
            for name, ws in self.weights.items()
        }

    def run_variant(self, variant: Variant) -> dict[str, float] | None:
        kernels = LinearKernels(variant.target())
        try:
            for name, ws in self.weights.items():
                got = kernels._launch(self.x[name], ws[0], None)
                torch.testing.assert_close(got.float(), self.ref[name].float(), atol=3e-2, rtol=3e-2)
            return self.time(lambda x, w: kernels._launch(x, w, None))
        except Exception as exc:  # out of shared memory, or wrong: reported, not fatal
            print(f"    {variant}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})", flush=True)
            return None


def step_us(times: dict[str, float]) -> float:
    return sum(PER_STEP[name] * t for name, t in times.items())


def weight_bytes(weights: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    return {name: ws[0].numel() * ws[0].element_size() for name, ws in weights.items()}


def describe(times: dict[str, float], nbytes: dict[str, int], copy_gbs: float) -> str:
    cells = " ".join(f"{name} {t:7.1f}us {nbytes[name] / t / 1e3 / copy_gbs:4.0%}" for name, t in times.items())
    step_bytes = sum(PER_STEP[name] * nbytes[name] for name in times)
    return f"step {step_us(times) / 1e3:6.3f} ms ({step_bytes / step_us(times) / 1e3 / copy_gbs:4.0%}) | {cells}"


def search(shapes: Shapes, path: str, quick: bool, nbytes, copy_gbs) -> tuple[Variant, dict[str, float]]:
    """Coordinate search over tiles, then warps x stages, then the split rule; the best variant and its times."""
    best: tuple[Variant, dict[str, float]] | None = None

    def consider(variants: list[Variant], group: str) -> None:
        nonlocal best
        for variant in variants:
            times = shapes.run_variant(variant)
            if times is None:
                continue
            print(f"  M={shapes.rows:<2} {group:<12} {variant!s:<34} {describe(times, nbytes, copy_gbs)}", flush=True)
            if best is None or step_us(times) < step_us(best[1]):
                best = (variant, times)

    consider(
        [Variant(path, n, k, waves=w) for n, k in (QUICK_TILES if quick else TILES) for w in WAVES], "tiles x split"
    )
    if best is None:
        raise RuntimeError(f"no {path} variant ran at {shapes.rows} rows")
    v = best[0]
    grid = QUICK_WARPS_STAGES if quick else WARPS_STAGES
    consider(
        [dataclasses.replace(v, warps=w, stages=s) for w, s in grid if (w, s) != (v.warps, v.stages)], "warps/stages"
    )
    v = best[0]
    consider([dataclasses.replace(v, waves=waves) for waves in WAVES if waves != v.waves], "split rule")
    return best


def pick(path: str, chosen, shapes_at: dict[int, Shapes]) -> tuple[Variant, dict[int, dict[str, float]]]:
    """One variant for ``path`` at every row count it was searched at: each row count's winner timed at
    all of them, the least total decode-step time kept."""
    searched = {rows: found for (rows, p), found in chosen.items() if p == path}
    timed: dict[Variant, dict[int, dict[str, float]]] = {}
    for variant, _ in searched.values():
        runs = {
            rows: found[1] if found[0] == variant else shapes_at[rows].run_variant(variant)
            for rows, found in searched.items()
        }
        if all(t is not None for t in runs.values()):
            timed[variant] = runs
    best = min(timed, key=lambda v: sum(step_us(t) for t in timed[v].values()))
    return best, timed[best]


def report(rows: int, variant: Variant, times, base, shapes: Shapes, nbytes, copy_gbs) -> dict:
    """One row count: per shape, cuBLAS and the kernel as graph-replayed chains, and by do_bench (eager)."""
    print(f"M={rows}: {variant}; decode step {step_us(times) / 1e3:.3f} ms vs cuBLAS {step_us(base) / 1e3:.3f} ms")
    kernels = LinearKernels(variant.target())
    found = {}
    for name, ws in shapes.weights.items():
        x, w = shapes.x[name], ws[0]
        ours_eager = cold_us(lambda x=x, w=w: kernels._launch(x, w, None))
        blas_eager = cold_us(lambda x=x, w=w: F.linear(x, w))

        def cell(t: float, n: str = name) -> str:
            return f"{t:7.1f} us ({nbytes[n] / t / 1e3 / copy_gbs:4.0%})"

        print(
            f"  {name:<8} cuBLAS graph {cell(base[name])} do_bench {cell(blas_eager)} | "
            f"triton graph {cell(times[name])} do_bench {cell(ours_eager)} | {base[name] / times[name]:4.2f}x"
        )
        found[name] = {
            "cublas_graph_us": base[name], "cublas_do_bench_us": blas_eager,
            "triton_graph_us": times[name], "triton_do_bench_us": ours_eager, "bytes": nbytes[name],
        }  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts (tokens)")
    parser.add_argument("--quick", action="store_true", help="a few variants per group (a smoke run)")
    parser.add_argument("--json", help="write the summary (per row count and shape) to this file")
    args = parser.parse_args()
    started = time.perf_counter()
    dev = torch.device(DEVICE)
    copy_gbs = copy_bandwidth_gbs(dev, 1 << 30)
    device_name = torch.cuda.get_device_name() if dev.type == "cuda" else dev.type
    print(f"{device_name}: copy {copy_gbs:.0f} GB/s; torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator(DEVICE).manual_seed(0)
    weights = {
        name: [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=gen) / k**0.5
            for _ in range(max(1, -(-CHAIN_BYTES // (n * k * 2))))
        ]
        for name, (n, k) in GEMV_SHAPES.items()
    }
    nbytes = weight_bytes(weights)
    capture = vllm_port.load().graph_capture()  # the CUDA plugin's, as the engine captures its decode steps
    shapes_at = {rows: Shapes(rows, weights, capture) for rows in (int(r) for r in args.rows.split(","))}
    chosen: dict[tuple[int, str], tuple[Variant, dict[str, float]]] = {}
    baselines: dict[int, dict[str, float]] = {}
    for rows, shapes in shapes_at.items():
        baselines[rows] = shapes.time(F.linear)
        print(f"M={rows:<2} {'cuBLAS':<47} {describe(baselines[rows], nbytes, copy_gbs)}", flush=True)
        for path in ("fma", "dot") if rows == 1 else ("dot",):
            chosen[(rows, path)] = search(shapes, path, args.quick, nbytes, copy_gbs)
            elapsed = time.perf_counter() - started
            print(f"M={rows:<2} best {path}: {chosen[(rows, path)][0]}  ({elapsed:.0f} s)", flush=True)

    print("\n=== one variant per path for every row count (each row count's winner timed at all) ===")
    picks = {path: pick(path, chosen, shapes_at) for path in ("fma", "dot") if any(p == path for _, p in chosen)}
    for path, (variant, runs) in picks.items():
        steps = " ".join(f"M={rows}: {step_us(t) / 1e3:.3f} ms" for rows, t in runs.items())
        print(f"  {path}: {variant} | {steps}")
    # one row: the vector-unit path, unless the tensor-core pick is faster there too
    one_row = {path: runs.get(1) for path, (_, runs) in picks.items()}
    use_fma = one_row.get("fma") is not None and (
        one_row.get("dot") is None or step_us(one_row["fma"]) <= step_us(one_row["dot"])
    )

    print(
        "\n=== us per call, % of copy bandwidth: graph-replayed chains (cold weights) and do_bench, cuBLAS beside the picks ==="
    )
    summary = {"device": device_name, "copy_gbs": copy_gbs, "torch": torch.__version__, "triton": triton.__version__}
    for rows, shapes in shapes_at.items():
        variant, runs = picks["fma" if rows == 1 and use_fma else "dot"]
        summary[f"M={rows}"] = {
            "variant": str(variant),
            "step_ms": {"cublas": step_us(baselines[rows]) / 1e3, "triton": step_us(runs[rows]) / 1e3},
            "shapes": report(rows, variant, runs[rows], baselines[rows], shapes, nbytes, copy_gbs),
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)

    print("\nTritonTarget knobs to paste (CUDA):")
    for label, path in (("linear_fma", "fma"), ("linear_dot", "dot")):
        if path == "fma" and "fma" in picks and not use_fma:
            print(f"    {label}=None,  # one row is faster on tensor cores")
        elif path in picks:
            v = picks[path][0]
            print(f"    {label}=LinearTiles({v.block_n}, {v.block_k}, {v.warps}, {v.stages}, {v.waves}),")
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
