"""The CPU plugin's native element-wise providers against its torch ones, per call; results in docs/results/cpu-elementwise.md."""

#     OMP_NUM_THREADS=1 .venv/bin/python dev/experiments/bench_cpu_elementwise.py [--dtypes ...] [--json OUT]
#     # the AVX2 floor on an AVX-512 machine: torch's AVX2 kernels, the library built for x86-64-v3
#     ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1 .venv/bin/python dev/experiments/bench_cpu_elementwise.py --march x86-64-v3
#
# rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding (NeoX, query and key as slices of a
# fused QKV row, positions in a 4096-row float32 table, as the models call it), each through the
# provider's whole function (argument check included), at the bundled model's shapes (hidden 256, 4
# heads of 64 over 2 KV heads, MLP 688), hidden 768 (12 x 64 over 4, MLP 3072) and hidden 4096 (32 x
# 128 over 8, MLP 14336), for 1, 16, 64 and 512 rows. Each time is the median over repeats of the mean
# per call of a batch sized to take about 20 ms; the providers alternate batch by batch. The machine is
# shared: each row records the 1-minute load average.

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from vllm_port.ops.rotary import make_cos_sin_cache
from vllm_port_cpu import native, native_elementwise, ops

MODELS = {  # name: (hidden, heads, kv_heads, head_size, intermediate)
    "bundled": (256, 4, 2, 64, 688),
    "hidden 768": (768, 12, 4, 64, 3072),
    "hidden 4096": (4096, 32, 8, 128, 14336),
}
ROWS = (1, 16, 64, 512)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")


def _calls(op: str, model: tuple[int, ...], rows: int, dtype: torch.dtype):
    """A function of a provider that calls it once on this shape's tensors (made once)."""
    hidden, heads, kv_heads, head_size, inter = model
    gen = torch.Generator().manual_seed(0)
    if op in ("rms_norm", "fused_add_rms_norm"):
        x = (0.01 * torch.randn(rows, hidden, generator=gen)).to(dtype)  # small: the residual grows slowly
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        if op == "rms_norm":
            return lambda p: p.fn(x, weight, 1e-5)
        return lambda p: p.fn(x, residual, weight, 1e-5)
    if op == "silu_and_mul":
        x = torch.randn(rows, 2 * inter, generator=gen).to(dtype)
        return lambda p: p.fn(x)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    table = make_cos_sin_cache(4096, head_size)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    return lambda p: p.fn(positions, q, k, head_size, table, True)


def _time(call, provider, seconds: float = 0.02) -> tuple[int, float]:
    """Calls per batch for about ``seconds``, and the first batch's mean (a warm-up)."""
    n, t = 1, 0.0
    while t < seconds:
        n *= 2
        start = time.perf_counter()
        for _ in range(n):
            call(provider)
        t = time.perf_counter() - start
    return n, t / n


def measure(op: str, model: tuple[int, ...], rows: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    call = _calls(op, model, rows, dtype)
    pair = {"native": getattr(native_elementwise, op), "torch": getattr(ops, op)}
    batch = {side: _time(call, p)[0] for side, p in pair.items()}
    samples: dict[str, list[float]] = {side: [] for side in pair}
    for _ in range(repeats):
        for side, p in pair.items():
            start = time.perf_counter()
            for _ in range(batch[side]):
                call(p)
            samples[side].append((time.perf_counter() - start) / batch[side] * 1e6)
    return {f"{side}_us": statistics.median(s) for side, s in samples.items()}


def _machine() -> dict[str, object]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout  # noqa: S607
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    flags = native._cpu_flags().split()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)  # noqa: S607
    return {
        "cpu": model,
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit.stdout.strip(),
        "library": native.status,
        "flags": " ".join(native.FLAGS),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    parser.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    parser.add_argument("--march", help="build the library with -march=MARCH instead of native (its own cache entry)")
    parser.add_argument("--json", help="write the rows and the machine here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.march:
        native.FLAGS = tuple(f"-march={args.march}" if f == "-march=native" else f for f in native.FLAGS)
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.status}")
    result = {"machine": _machine(), "threads": args.threads, "load_before": os.getloadavg(), "rows": []}
    print(f"# {result['machine']}; threads {args.threads}; load {os.getloadavg()}")
    print("| op | model | dtype | rows | torch us | native us | speedup | load |")
    for op in args.ops:
        for name in args.models:
            for dtype_name in args.dtypes:
                for rows in args.rows:
                    row = measure(op, MODELS[name], rows, DTYPES[dtype_name], args.repeats)
                    row.update(op=op, model=name, dtype=dtype_name, rows=rows, load=os.getloadavg()[0])
                    row["speedup"] = row["torch_us"] / row["native_us"]
                    result["rows"].append(row)
                    print(
                        f"| {op} | {name} | {dtype_name} | {rows} | {row['torch_us']:.1f} | {row['native_us']:.1f} "
                        f"| {row['speedup']:.2f} | {row['load']:.2f} |",
                        flush=True,
                    )
    result["load_after"] = os.getloadavg()
    print(f"# load after {result['load_after']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
