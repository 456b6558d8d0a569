"""A sampled offline run with and without the sampler's sort (issue 30): what ``top_k``/``top_p`` ``None`` saves.

``vllm-port bench engine`` is greedy; vLLM's own throughput benchmark samples (temperature 1, top_p 1). This runs
one engine on MODEL_DIR over the offline workload (Llama-3-8B's: 256 requests of 512 prompt / 256 output tokens),
every request sampled at temperature 1 with its own seed, in two modes:

- ``none``: as the engine runs since 569cd6c. No sampled row truncates, so ``sample`` gets ``top_k``/``top_p``
  ``None`` and the Triton provider skips its sort;
- ``tensors``: ``sample`` is handed top-k 0 and top-p 1 as tensors, as every sampled step was before. The
  provider sorts every row's vocabulary.

Each mode runs once untimed, then both are timed twice in the order none, tensors, tensors, none, so that a drift
of the machine falls on both alike. The two modes draw the same tokens unless a token whose probability is
lost to float32 rounding wins a draw. The probe counts the requests whose tokens differ.

    python3 dev/experiments/probe_sampled_run.py MODEL_DIR [--build] [--device cuda]
        [--requests 256] [--prompt-len 512] [--output-len 256]

``--build`` first saves a random model of Llama-3-8B's shape at MODEL_DIR, unless one is there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from vllm_port.bench.engine_workload import H200_WORKLOAD, build_model
from vllm_port.engine import LLM, SamplingParams
from vllm_port.ops.sampling import filled_truncation


def _timed_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list[list[int]]]:
    """Seconds for the whole run (its tokens read on the host), and each request's token ids."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--requests", type=int, default=H200_WORKLOAD.num_requests)
    ap.add_argument("--prompt-len", type=int, default=H200_WORKLOAD.prompt_len)
    ap.add_argument("--output-len", type=int, default=H200_WORKLOAD.output_len)
    args = ap.parse_args()
    if args.build and not (Path(args.model) / "config.json").is_file():
        build_model(args.model, H200_WORKLOAD, device=args.device)
    llm = LLM(
        args.model,
        device=args.device,
        max_model_len=args.prompt_len + args.output_len,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
        seed=0,
    )
    vocab = llm.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (args.requests, args.prompt_len), generator=g).tolist()
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True, seed=i)
        for i in range(args.requests)
    ]
    provider = llm.runner.ops.providers["sample"].name
    as_engine = llm.runner.ops.sample

    def with_tensors(logits: Any, temperature: Any, top_k: Any, top_p: Any, seeds: Any) -> Any:
        top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
        return as_engine(logits, temperature, top_k, top_p, seeds)

    modes = {"none": as_engine, "tensors": with_tensors}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list[list[int]]] = {}
    print(f"{args.requests} requests x {args.prompt_len}/{args.output_len}, temperature 1, sample provider {provider}")
    try:
        for fn in modes.values():  # first use off the clock
            llm.runner.ops.sample = fn
            _timed_run(llm, prompts, params)
        for mode in ("none", "tensors", "tensors", "none"):
            llm.runner.ops.sample = modes[mode]
            took, tokens[mode] = _timed_run(llm, prompts, params)
            seconds[mode].append(took)
            print(f"  {mode:8s} {took:7.3f} s  {args.requests * args.output_len / took:9,.0f} output tok/s", flush=True)
    finally:
        llm.runner.ops.sample = as_engine
        llm.close()
    rates = {mode: args.requests * args.output_len * len(s) / sum(s) for mode, s in seconds.items()}
    differ = sum(a != b for a, b in zip(tokens["none"], tokens["tensors"], strict=True))
    print(
        f"output tok/s: none {rates['none']:,.0f}, tensors {rates['tensors']:,.0f} "
        f"({rates['none'] / rates['tensors']:.3f}x); requests whose tokens differ: {differ} of {args.requests}"
    )


if __name__ == "__main__":
    main()
