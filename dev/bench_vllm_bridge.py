"""vLLM alone beside vLLM with the bridge and a certified plugin: same vLLM, model and workload, back to back.

    .venv/bin/python dev/bench_vllm_bridge.py --vllm-python VENV/bin/python --certificate cert/report.json \
        [--models engine,768] [--repeats 2] [--out docs/results/bridge-cpu]

``VENV`` is a vLLM environment with this checkout's core, CPU plugin, suite and bridge installed
(``bridges/vllm/tests/test_vllm.py`` makes one over ``dev/setup-vllm-peer``'s venv; see
docs/vllm-bridge.md). Each run is ``dev/vllm_peer.py`` (the peer script of ``vllm-port bench
engine``: output tok/s over a whole greedy ``generate``, and the time to first token of the batch)
in a fresh vLLM process: ``VLLM_PLUGINS=""`` for vLLM alone (no plugin loads), the bridge with
``VLLM_PORT_CERTIFICATE`` for the other, alternating which goes first. Models: ``engine`` is the
engine benchmark's CPU shape (hidden 512, 8 layers, 8:4 heads), ``768`` hidden 768, 12 layers, 12:4
heads; both random-weight Llamas in float32, 64 requests of 128 prompt and 128 output tokens (flags).
The load average is read before and after each run. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from vllm_port.bench.engine import CPU_WORKLOAD, PEER_SCRIPT, build_model, make_prompts

MODELS = {
    "engine": CPU_WORKLOAD,
    "768": replace(CPU_WORKLOAD, hidden_size=768, intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=4),
}


def run_peer(python: str, model: Path, prompts: Path, output_len: int, bridged: bool, cert: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS", "VLLM_PORT_STATS")}
    env.update({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu"})
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if bridged:
        env.update({"VLLM_PORT_CERTIFICATE": cert, "VLLM_PORT_PLUGINS": "cpu"})
    else:
        env["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin: vLLM alone
    cmd = [python, str(PEER_SCRIPT), "--model", str(model), "--prompts", str(prompts), "--output-len", str(output_len)]
    load, before = os.getloadavg(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)  # noqa: S603 - our peer script
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {(done.stderr or done.stdout)[-3000:]}")
    result = json.loads(lines[-1])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["load_before"], result["load_after"] = load, os.getloadavg()
    # CPU seconds of the whole vLLM process tree (its engine core is a child the peer script waits for):
    # on a shared machine they move far less with the load than wall time does; startup included
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # the kernel's share (page faults, futex waits) and the pages faulted in: steadier still than wall time
    result["sys_cpu_s"] = after.ru_stime - before.ru_stime
    result["minor_faults"] = after.ru_minflt - before.ru_minflt
    return result


def render(result: dict[str, Any]) -> str:
    lines = [
        "# vLLM alone and vLLM with the bridge (CPU plugin), same vLLM, model and workload",
        "",
        f"`{' '.join(result['argv'])}` on {result['host']}, {result['started']}; vLLM {result['vllm']}, torch "
        f"{result['torch']}. Each row: fresh vLLM processes, alternating which side runs first; output tok/s "
        "over the whole greedy `generate`, TTFT = wall time of the batch with one output token; load "
        "average (1 min) before each run.",
        "",
        "| model | run | vLLM alone tok/s | bridge tok/s | ratio | alone TTFT s | bridge TTFT s | CPU s (alone, bridge) | "
        "sys CPU s | minor faults (k) | load before (alone, bridge) | first ids equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, runs in result["models"].items():
        for i, r in enumerate(runs):
            a, b = r["alone"], r["bridge"]
            lines.append(
                f"| {name} | {i + 1} | {a['output_tok_s']:.1f} | {b['output_tok_s']:.1f} | "
                f"{b['output_tok_s'] / a['output_tok_s']:.3f} | {a['ttft_batch_s']:.2f} | {b['ttft_batch_s']:.2f} | "
                f"{a.get('cpu_s', float('nan')):.0f}, {b.get('cpu_s', float('nan')):.0f} | "
                f"{a.get('sys_cpu_s', float('nan')):.1f}, {b.get('sys_cpu_s', float('nan')):.1f} | "
                f"{a.get('minor_faults', 0) / 1e3:.0f}, {b.get('minor_faults', 0) / 1e3:.0f} | "
                f"{a['load_before'][0]:.2f}, {b['load_before'][0]:.2f} | {a['token_ids_head'] == b['token_ids_head']} |"
            )
        ratios = [r["bridge"]["output_tok_s"] / r["alone"]["output_tok_s"] for r in runs]
        lines.append(
            f"| {name} | best of each | | | {max(r['bridge']['output_tok_s'] for r in runs) / max(r['alone']['output_tok_s'] for r in runs):.3f} | | | | | | | |"
        )
        result.setdefault("ratios", {})[name] = ratios
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--certificate", required=True)
    parser.add_argument("--models", default="engine,768")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default="docs/results/bridge-cpu")
    args = parser.parse_args()
    probe = [args.vllm_python, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"]
    vllm_version, torch_version = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()[-2:]  # noqa: S603
    result: dict[str, Any] = {
        "argv": [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
        "host": f"{os.cpu_count()} CPUs",
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "vllm": vllm_version,
        "torch": torch_version,
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            w = replace(
                MODELS[name], num_requests=args.requests, prompt_len=args.prompt_len, output_len=args.output_len
            )
            model = build_model(Path(tmp) / name, w)
            prompts = Path(tmp) / f"{name}-prompts.json"
            prompts.write_text(json.dumps(make_prompts(w)))
            runs = []
            for i in range(args.repeats):
                order = ("alone", "bridge") if i % 2 == 0 else ("bridge", "alone")
                run = {}
                for side in order:
                    print(f"{name} run {i + 1}: {side} ...", flush=True)
                    run[side] = run_peer(
                        args.vllm_python, model, prompts, w.output_len, side == "bridge", args.certificate
                    )
                    print(
                        f"  {run[side]['output_tok_s']:.1f} tok/s, load {run[side]['load_before'][0]:.2f}", flush=True
                    )
                runs.append(run)
            result["models"][name] = runs
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")  # before rendering: the data is kept
    text = render(result)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    Path(f"{args.out}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
