"""What the NaN/Inf checks cost: ``python core/tests/faults/bench_nonfinite.py [--json F]`` (a benchmark, not a test).

In one run, side by side:

* **loading**: ``load_model`` of the bundled model and of a synthetic ~1 GB bfloat16 Llama checkpoint
  written to a temporary directory (random weights; the file is in the page cache after writing),
  with ``VLLM_PORT_CHECK_WEIGHTS=1`` and ``=0`` in alternation, several rounds;
* **one engine step**: ``ModelRunner.execute`` on the bundled model (CPU plugin), with its
  finite-logits flag and id range check, against the same step as it was before them
  (:func:`step_before`: ``sampled.tolist()``, nothing checked), alternating on the same recorded
  batches (16 requests, their prefill and decode steps), greedy and sampled.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.data import bundled_model_dir
from vllm_port.engine.runner import ModelRunner
from vllm_port.engine.scheduler import StepBatch
from vllm_port.models import expected_weights, load_config, load_model, load_weights

#: the synthetic checkpoint: 8 layers of hidden 2048 / MLP 5632, vocabulary 32000: 477M parameters, 954 MB in bf16
SYNTHETIC = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 128,
    "vocab_size": 32000,
}


def step_before(runner: ModelRunner, batch: StepBatch) -> list[int]:
    """``ModelRunner.execute`` as it was before the finite check (the baseline; same blame, same tensors)."""
    from vllm_port.ops.debug import blame

    runner._migrate(batch)
    with torch.inference_mode(), blame(runner.ops):
        ids, positions, meta, rows, top_k, seeds, temperature, top_p = runner._tensors(batch)
        logits = runner.step(ids, positions, runner.kv_caches, meta, rows)
        if not batch.sample_rows:
            return []
        if any(batch.temperatures):
            sampled = runner.ops.sample(logits, temperature, top_k, top_p, seeds)
        else:
            sampled = logits.to(torch.promote_types(logits.dtype, torch.float32)).argmax(dim=-1)
    return sampled.tolist()


def synthetic_checkpoint(directory: Path) -> Path:
    """A Llama directory of random bfloat16 weights with :data:`SYNTHETIC`'s sizes."""
    config = json.loads((bundled_model_dir() / "config.json").read_text())
    config.update(SYNTHETIC)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    specs = expected_weights(load_config(directory))
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16) for name, spec in specs.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def time_loads(model_dir: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds of ``load_model`` with the check on and off, alternating (off first in odd rounds)."""
    dtype = load_config(model_dir).dtype
    seconds: dict[str, list[float]] = {"check on": [], "check off": []}
    load_model(model_dir, "cpu", dtype)  # warm: the file in the page cache, the allocator primed
    for r in range(rounds):
        order = ("check on", "check off") if r % 2 == 0 else ("check off", "check on")
        for label in order:
            os.environ["VLLM_PORT_CHECK_WEIGHTS"] = "1" if label == "check on" else "0"
            start = time.perf_counter()
            model = load_model(model_dir, "cpu", dtype)
            seconds[label].append(time.perf_counter() - start)
            del model
    os.environ.pop("VLLM_PORT_CHECK_WEIGHTS", None)
    return seconds


def time_check_pass(model_dir: Path, rounds: int) -> list[float]:
    """Seconds of the finite check alone over a loaded model's weights (what ``load_weights`` adds per load)."""
    from vllm_port.models.loader import _all_finite

    os.environ["VLLM_PORT_CHECK_WEIGHTS"] = "0"
    config = load_config(model_dir)
    weights = load_weights(model_dir, config, "cpu", config.dtype)
    os.environ.pop("VLLM_PORT_CHECK_WEIGHTS", None)
    seconds = []
    for _ in range(rounds):
        start = time.perf_counter()
        assert all(torch.stack([_all_finite(w) for w in weights.values()]).tolist())
        seconds.append(time.perf_counter() - start)
    return seconds


def recorded_batches(llm: LLM, params: SamplingParams, prompts: list[str]) -> list[StepBatch]:
    """The step batches one ``generate`` runs (recorded as they pass to the runner)."""
    batches: list[StepBatch] = []
    execute = llm.runner.execute

    def record(batch: StepBatch) -> Any:
        batches.append(batch)
        return execute(batch)

    llm.runner.execute = record  # type: ignore[method-assign]
    llm.generate(prompts, params)
    llm.runner.execute = execute  # type: ignore[method-assign]
    return batches


def time_steps(rounds: int) -> dict[str, Any]:
    """Microseconds per step, the runner's execute against :func:`step_before`, on the same batches."""
    llm = LLM(device=vllm_port.load(plugins="cpu", device="cpu"), kv_cache_memory=16 << 20)
    prompts = [f"Prompt number {i} about the sea and the sky" for i in range(16)]
    results: dict[str, Any] = {}
    for mode, params in (
        ("greedy", SamplingParams(temperature=0, max_tokens=32)),
        ("sampled", SamplingParams(temperature=0.8, top_k=40, top_p=0.9, max_tokens=32)),
    ):
        batches = recorded_batches(llm, params, prompts)
        decode = [b for b in batches if b.is_decode]
        runs: dict[str, list[float]] = {"with the checks": [], "before them": []}
        steps = {"with the checks": llm.runner.execute, "before them": lambda b: step_before(llm.runner, b)}
        for r in range(rounds):  # each batch run both ways in turn, the order swapped every round
            total = dict.fromkeys(runs, 0.0)
            for b in decode:
                for label in list(steps) if r % 2 == 0 else list(reversed(steps)):
                    start = time.perf_counter()
                    steps[label](b)
                    total[label] += time.perf_counter() - start
            for label in runs:
                runs[label].append(total[label] / len(decode) * 1e6)
        results[mode] = {"decode steps": len(decode), "batch": len(decode[0].query_lens), "us per step": runs}
    llm.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
        "load average at start": os.getloadavg(),
        "torch threads": torch.get_num_threads(),
    }
    scratch = Path(tempfile.mkdtemp(prefix="vllm-port-bench-nonfinite-"))
    try:
        big = synthetic_checkpoint(scratch / "synthetic")
        report["synthetic checkpoint bytes"] = (big / "model.safetensors").stat().st_size
        report["load s"] = {
            "bundled model": time_loads(bundled_model_dir(), args.rounds * 4),
            "synthetic ~1 GB": time_loads(big, args.rounds),
        }
        report["check pass alone s"] = {
            "bundled model": time_check_pass(bundled_model_dir(), args.rounds * 4),
            "synthetic ~1 GB": time_check_pass(big, args.rounds),
        }
    finally:
        shutil.rmtree(scratch)
    report["step"] = time_steps(args.rounds)
    report["load average at end"] = os.getloadavg()
    for what, runs in report["load s"].items():
        on, off = (statistics.median(runs[k]) for k in ("check on", "check off"))
        print(f"load {what}: check on {on:.4f} s, off {off:.4f} s (median; +{(on / off - 1) * 100:.1f}%)")
    for what, runs in report["check pass alone s"].items():
        print(f"check pass alone, {what}: {statistics.median(runs):.4f} s (median)")
    for mode, found in report["step"].items():
        new, old = (statistics.median(found["us per step"][k]) for k in ("with the checks", "before them"))
        print(f"{mode} decode step, batch {found['batch']}: {new:.0f} us with the checks, {old:.0f} us before (median)")
    print(f"load average {report['load average at start']} -> {report['load average at end']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
