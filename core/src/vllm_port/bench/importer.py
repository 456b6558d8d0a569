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
``generate`` of ``output_len`` tokens minus that of one token (the prefill). Each model is warm at
``B`` before it is timed: a greedy run of all ``B`` prompts for a few tokens first, so the first
prefill and decode steps at that batch size (kernel selection, compilation for new shapes, first
graph replays) are not timed. Then the decode is timed ``--repeats`` times (default 2) and the
fastest run is reported, the least disturbed one: other work on the host only ever adds time
(``decode_s_runs`` in the JSON keeps every run). Prints a markdown table.

Token agreement: the greedy tokens of the first ``COMPARED_SEQUENCES`` sequences of the batch,
core against imported, and for each the number of leading tokens that agree; the table shows the
least of them (``agreeing_tokens`` in the JSON has each, ``tokens`` each model's token lists). This
is not the equality test. Equal greedy tokens are proven on CPU in float32 by
``test_imported_greedy_output_equals_transformers_generate`` (``core/tests/importer/test_importer.py``:
imported against transformers, 64 tokens, every family) and ``test_greedy_matches_transformers_generate``
(``core/tests/engine/test_llm.py``: core against transformers). With random weights in bfloat16 the
top logits are near-ties, and the two models round differently (other kernels, fused projections,
another summation order), so their greedy tokens part after a few tokens: legitimate rounding,
which the column reports as it is.
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

__all__ = ["TINY_WORKLOAD", "leading_agreement", "main", "render", "run"]

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
#: Sequences of each batch whose greedy tokens are compared, core against imported, and kept in the JSON.
COMPARED_SEQUENCES = 8
#: Tokens of the warm-up run of every prompt of a batch: enough for decode steps at the batch size.
WARM_UP_TOKENS = 4


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


def _decode_rate(
    model_dir: Path, importer: str | None, w: Workload, batch: int, device: str, step: str, repeats: int
) -> dict:
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
        # every prompt, so that the first prefill and decode steps at this batch size are not timed
        warm_up(llm, prompts, num_prompts=batch, max_tokens=WARM_UP_TOKENS)
        timings = [time_decode(llm, prompts, w.output_len) for _ in range(repeats)]
        # a run whose one-token run took longer than its decode (timer noise on a tiny model) is no rate
        fastest = min([t for t in timings if t.decode_s > 0] or timings, key=lambda t: t.decode_s)
        return {
            "batch": batch,
            **decode_rate(batch, w.output_len, fastest.decode_s),
            "decode_s_runs": [t.decode_s for t in timings],
            "load_s": load_s,
            "platform": llm.platform,
            "captured": bool(llm.captured_batch_sizes),
            "tokens": [list(o.outputs[0].token_ids) for o in fastest.outputs[:COMPARED_SEQUENCES]],
        }
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.accelerator.is_available():
            torch.accelerator.empty_cache()


def leading_agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (``len`` of both when they are equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


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
    repeats: int = 2,
) -> dict[str, Any]:
    """Both models at each batch size, each the fastest of ``repeats`` timed runs after a warm-up at that size.

    ``model_dir``/``save_model`` as ``bench engine`` (build once, reuse).
    """
    if step not in STEPS:
        raise ValueError(f"step {step!r}: use one of {', '.join(STEPS)}")
    if repeats < 1:
        raise ValueError(f"repeats {repeats}: time at least one run per model and batch size (use 1 or more)")
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(model_dir or save_model or scratch)
        if not (path / "config.json").is_file():
            build_model(path, w, device=build_device(device))
        else:  # an existing checkpoint: report its shape, not the workload's defaults
            w = _shape_of(path, w)
        batches = list(dict.fromkeys(batches))  # each size once: a row pair per batch size
        rows = []
        for batch in batches:
            for name, importer in (("core", None), ("imported", "hf")):
                rows.append({"model": name, **_decode_rate(path, importer, w, batch, device, step, repeats)})
    for batch in batches:
        core, imported = (r for r in rows if r["batch"] == batch)
        imported["vs_core"] = imported["decode_tok_s"] / core["decode_tok_s"]
        agreeing = [leading_agreement(a, b) for a, b in zip(imported["tokens"], core["tokens"], strict=True)]
        imported["agreeing_tokens"] = agreeing
        imported["min_agreeing_tokens"] = min(agreeing)
    return {
        "workload": asdict(w),
        "step": step,
        "device": device,
        "repeats": repeats,
        "rows": rows,
        "torch": torch.__version__,
    }


def render(result: dict[str, Any]) -> str:
    """The result as a markdown table."""
    w = result["workload"]
    runs = result.get("repeats", 1)
    lines = [
        f"Decode tok/s, core vs imported model, same weights: hidden {w['hidden_size']}, {w['num_layers']} layers, "
        f"{w['dtype']}, prompt {w['prompt_len']}, output {w['output_len']}; step {result['step']}; each model "
        f"warmed up at each batch size, then the fastest of {runs} timed run{'s' if runs != 1 else ''}; agreeing "
        f"tokens: the least number of leading greedy tokens the imported model shares with the core one, over the "
        f"first {COMPARED_SEQUENCES} sequences or fewer (random weights in bf16 part at near-tied logits; the CPU "
        "float32 tests prove token equality)",
        "",
        "| batch | model | decode tok/s | step ms | vs core | captured | agreeing tokens | load s |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in result["rows"]:
        ratio = f"{r['vs_core']:.2f}x" if "vs_core" in r else ""
        agree = f"{r['min_agreeing_tokens']} of {w['output_len']}" if "min_agreeing_tokens" in r else ""
        lines.append(
            f"| {r['batch']} | {r['model']} | {r['decode_tok_s']:.1f} | {r['step_ms']:.2f} | {ratio} | "
            f"{'yes' if r['captured'] else 'no'} | {agree} | {r['load_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_port.bench.importer", description=__doc__.split("\n")[0], allow_abbrev=False
    )
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
    parser.add_argument(
        "--repeats", type=int, default=2, help="timed runs per model and batch size, the fastest reported (default 2)"
    )
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
    result = run(w, batches, args.device, args.step, args.model, args.save_model, args.repeats)
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
