"""Decode tokens/s of the core model and of the same checkpoint imported from ``transformers``, in one run.

::

    python -m vllm_port.bench.importer --h200 --save-model /data/llama3-8b-random   # the GPU run
    python -m vllm_port.bench.importer --tiny                                       # CPU smoke run

One random-weight Llama checkpoint (``bench.engine.build_model``: Llama-3-8B's shape in bf16 with
``--h200``, saved once with ``--save-model`` and reused) is run through the engine twice per batch
size: as the core model (``LLM(dir)``) and imported (``LLM(dir, importer="hf")``: transformers
loads it, ``vllm_port.importer`` rewrites it). Both use the same step kind: ``--step default`` is
what the engine picks for each (on a platform with graph capture: the flat graphs with the fusion
passes and captured decode steps; elsewhere the model's forward with the bound ops), ``--step
eager`` forces the bound ops op by op, ``--step flat`` the flat graphs without capture.

Decode tokens/s at a batch ``B``: ``B * (output_len - 1)`` tokens over the wall time of a greedy
``generate`` of ``output_len`` tokens minus that of one token (the prefill). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ._decode import decode_rate, time_decode, warm_up
from .engine import H200_WORKLOAD, Workload, build_device, build_model, make_prompts

__all__ = ["TINY_WORKLOAD", "main", "render", "run"]

#: A model small enough for a CPU smoke run (tests).
TINY_WORKLOAD = Workload(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    prompt_len=16,
    output_len=8,
    num_requests=1,
)
STEPS = ("default", "eager", "flat")


def _make_step(step: str) -> Any:
    from ..engine.runner import eager_step, flat_step

    if step == "eager":
        return lambda runner: eager_step(runner.model, runner.ops)
    if step == "flat":
        from ..flat import FlatModel

        return lambda runner: flat_step(
            FlatModel(runner.model, runner.runtime, runner.model.dtype, compile=False, block_size=runner.block_size)
        )
    return None


def _decode_rate(model_dir: Path, importer: str | None, w: Workload, batch: int, device: str, step: str) -> dict:
    from ..engine import LLM

    make_step = _make_step(step)
    start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        device=device,
        dtype=w.dtype,
        max_model_len=w.prompt_len + w.output_len,
        max_num_seqs=batch,
        enable_prefix_caching=False,
        seed=0,
        importer=importer,
        **({"make_step": make_step} if make_step is not None else {}),
    )
    load_s = time.perf_counter() - start
    try:
        prompts = make_prompts(replace(w, num_requests=batch), seed=1)
        warm_up(llm, prompts)
        timing = time_decode(llm, prompts, w.output_len)
        return {
            "batch": batch,
            **decode_rate(batch, w.output_len, timing.decode_s),
            "load_s": load_s,
            "platform": llm.platform,
            "captured": bool(llm.captured_batch_sizes),
            "first_tokens": [o.outputs[0].token_ids[:8] for o in timing.outputs[:2]],
        }
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()


def _shape_of(path: Path, w: Workload) -> Workload:
    """``w`` with the model shape of the checkpoint at ``path`` (its config.json)."""
    from ..models import load_config

    c = load_config(path)
    return replace(
        w,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        vocab_size=c.vocab_size,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
    )


def run(
    w: Workload,
    batches: list[int],
    device: str = "auto",
    step: str = "default",
    model_dir: str | None = None,
    save_model: str | None = None,
) -> dict[str, Any]:
    """Both models at each batch size; ``model_dir``/``save_model`` as ``bench engine`` (build once, reuse)."""
    if step not in STEPS:
        raise ValueError(f"step {step!r}: use one of {', '.join(STEPS)}")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(model_dir or save_model or scratch)
        if not (path / "config.json").is_file():
            build_model(path, w, device=build_device(device))
        else:  # an existing checkpoint: report its shape, not the workload's defaults
            w = _shape_of(path, w)
        rows = []
        for batch in batches:
            for name, importer in (("core", None), ("imported", "hf")):
                rows.append({"model": name, **_decode_rate(path, importer, w, batch, device, step)})
    for batch in batches:
        core, imported = (r for r in rows if r["batch"] == batch)
        imported["vs_core"] = imported["decode_tok_s"] / core["decode_tok_s"]
        imported["same_tokens"] = imported["first_tokens"] == core["first_tokens"]
    return {"workload": asdict(w), "step": step, "device": device, "rows": rows, "torch": torch.__version__}


def render(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    w = result["workload"]
    lines = [
        f"Decode tok/s, core vs imported model, same weights: hidden {w['hidden_size']}, {w['num_layers']} layers, "
        f"{w['dtype']}, prompt {w['prompt_len']}, output {w['output_len']}; step {result['step']}",
        "",
        "| batch | model | decode tok/s | step ms | vs core | captured | same first tokens | load s |",
        "| ---: | --- | ---: | ---: | ---: | --- | --- | ---: |",
    ]
    for r in result["rows"]:
        ratio = f"{r['vs_core']:.2f}x" if "vs_core" in r else ""
        same = {True: "yes", False: "no"}.get(r.get("same_tokens"), "")
        lines.append(
            f"| {r['batch']} | {r['model']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | {ratio} | "
            f"{'yes' if r['captured'] else 'no'} | {same} | {r['load_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_port.bench.importer", description=__doc__.split("\n")[0])
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--h200", action="store_true", help="Llama-3-8B's shape in bf16 (the GPU workload)")
    shape.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    parser.add_argument("--device", default="auto", help="platform name (default: the selected one)")
    parser.add_argument("--step", default="default", choices=STEPS, help="the step kind both models run")
    parser.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--dtype", default=None, help="the models' dtype (default: bfloat16 with --h200, else float32)")
    parser.add_argument("--model", default=None, help="an existing checkpoint directory (Llama) to use")
    parser.add_argument("--save-model", default=None, help="build the random model here, or reuse the one there")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    w = (
        replace(H200_WORKLOAD, prompt_len=512, output_len=128)
        if args.h200
        else TINY_WORKLOAD
        if args.tiny
        else Workload()
    )
    w = replace(
        w,
        prompt_len=args.prompt_len or w.prompt_len,
        output_len=args.output_len or w.output_len,
        dtype=args.dtype or w.dtype,
    )
    batches = [int(b) for b in args.batches.split(",")]
    result = run(w, batches, args.device, args.step, args.model, args.save_model)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
