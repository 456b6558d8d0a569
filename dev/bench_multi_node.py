"""Two-node tensor and pipeline parallelism on this machine beside one process: the same greedy batch, wall time each.

Runs ``vllm-port generate`` on the bundled model (or ``--model DIR``) six ways, one after another:
one process with 1 thread, one process with 2 threads, then TP=2 and PP=2 each spawned on this
machine and as two ``torchrun`` "nodes" on 127.0.0.1 (gloo, one rank and 1 thread each,
``--distributed-executor-backend external_launcher``). Prints a Markdown table (tokens, generate's own
seconds, tokens/s), whether the outputs are equal, the latency of the gloo calls a launched step adds
(two ranks of ``vllm_port.spawn.run_ranks``), and the load average before and after; ``--json FILE``
keeps the numbers.

    .venv/bin/python dev/bench_multi_node.py --json docs/results/multi-node-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

PROMPTS = [f"Once upon a time there was a {thing}" for thing in ("king", "cat", "river", "robot", "forest", "ship")]
_GENERATED = re.compile(r"generated (\d+) tokens for \d+ request\(s\) in ([\d.]+) s")


def _collective_latencies(ctx) -> dict[str, float]:
    """Microseconds a call of each collective a step makes takes on this rank (200 calls after 20 to warm up)."""
    import time

    import torch

    from vllm_port.runtime import load

    comm = load(None, "cpu").communicator()
    calls = {
        "all_gather of 16 bytes (the step's digest)": lambda: comm.all_gather(torch.zeros(1, 16, dtype=torch.uint8)),
        "broadcast of 8 bytes (the tokens' length)": lambda: comm.broadcast(torch.zeros(1, dtype=torch.int64), 0),
        "broadcast of 200 bytes (the tokens)": lambda: comm.broadcast(torch.zeros(200, dtype=torch.uint8), 0),
        "all_reduce of 512 bfloat16 (a row-parallel output)": lambda: comm.all_reduce(
            torch.zeros(1, 512, dtype=torch.bfloat16)
        ),
        "send/recv of 6 x 256 bfloat16 (a decode step's residual, stage 0 to 1)": lambda: (
            comm.send(torch.zeros(6, 256, dtype=torch.bfloat16), 1)
            if ctx.rank == 0
            else comm.recv(torch.zeros(6, 256, dtype=torch.bfloat16), 0)
        ),
    }
    found = {}
    for name, call in calls.items():
        for _ in range(20):
            call()
        start = time.perf_counter()
        for _ in range(200):
            call()
        found[name] = (time.perf_counter() - start) / 200 * 1e6
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _generate_args(args: argparse.Namespace) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return ["generate", *model, "--json", "--temperature", "0", "--ignore-eos", "--max-tokens", str(args.max_tokens)]


def _run(cmd: list[str], threads: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # noqa: S603 - our own CLI


def _result(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(proc.args)} exited {proc.returncode}:\n{err[-3000:]}")
    tokens, seconds = _GENERATED.search(err).groups()
    outputs = [o["token_ids"] for o in json.loads(out.strip().splitlines()[-1])["outputs"]]
    return {"tokens": int(tokens), "seconds": float(seconds), "outputs": outputs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "vllm_port.cli", *_generate_args(args), *PROMPTS]
    load_before = os.getloadavg()
    rows = {
        "one process, 1 thread": _result(_run(cli, 1)),
        "one process, 2 threads": _result(_run(cli, 2)),
    }
    agree = {}
    for mode, split in (("TP", "--tensor-parallel-size"), ("PP", "--pipeline-parallel-size")):
        spawned = rows[f"{mode}=2 spawned on this machine (mp), 1 thread each"] = _result(_run([*cli, split, "2"], 1))
        ranks = _two_nodes(args, split)
        rows[f"two torchrun nodes, {mode}=2, 1 thread each (rank 0)"] = ranks[0]
        agree[mode] = ranks[0]["outputs"] == ranks[1]["outputs"] == spawned["outputs"]
    from vllm_port.runtime import load
    from vllm_port.spawn import run_ranks

    latencies = run_ranks(_collective_latencies, load(None, "cpu").platform, 2)[0]
    load_after = os.getloadavg()
    alone = rows["one process, 1 thread"]["outputs"]
    first_diff = {
        mode: [
            next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None)
            for x, y in zip(
                alone, rows[f"{mode}=2 spawned on this machine (mp), 1 thread each"]["outputs"], strict=True
            )
        ]
        for mode in agree
    }
    print(f"{len(PROMPTS)} prompts x {args.max_tokens} tokens, greedy, model {args.model or 'bundled'}\n")
    print("| run | tokens | generate (s) | tok/s |\n| --- | ---: | ---: | ---: |")
    for name, row in rows.items():
        print(f"| {name} | {row['tokens']} | {row['seconds']:.2f} | {row['tokens'] / row['seconds']:.0f} |")
    for mode, same in agree.items():
        print(f"\n{mode}=2: the two nodes' outputs equal each other and the spawned run's, token for token: {same}")
        print(f"{mode}=2 against one process, first differing token per prompt (None: equal): {first_diff[mode]}")
    print("\n| gloo call, 2 ranks on 127.0.0.1 | us a call |\n| --- | ---: |")
    for name, us in latencies.items():
        print(f"| {name} | {us:.0f} |")
    print(f"\nload average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}")
    if args.json:
        data = {name: {k: v for k, v in row.items() if k != "outputs"} for name, row in rows.items()}
        data.update(nodes_agree_with_spawned=agree, first_diff_vs_one_process=first_diff)
        data.update(collective_us=latencies, load_before=load_before[0], load_after=load_after[0])
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(agree.values()) else 1


def _two_nodes(args: argparse.Namespace, split: str) -> list[dict]:
    """``vllm-port generate`` on two torchrun nodes of one rank each, the model split by ``split``; each node's result."""
    port = _free_port()
    nodes = []
    for rank in range(2):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        torchrun += ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        launched = ["-m", "vllm_port.cli", *_generate_args(args), split, "2"]
        launched += ["--distributed-executor-backend", "external_launcher", *PROMPTS]
        nodes.append(_run([*torchrun, *launched], 1))
    return [_result(node) for node in nodes]


if __name__ == "__main__":
    sys.exit(main())
