"""vLLM's side of ``vllm-port bench engine``: the same workload on the same model directory, one JSON line.

Runs in vLLM's own venv (``dev/setup-vllm-peer``), not in CI. Prompts are token ids from a JSON file
(``[[id, ...], ...]``, written by the benchmark), so both sides run exactly the same requests; the
model needs no tokenizer. Prints ``{"output_tok_s", "elapsed_s", "output_tokens", "ttft_batch_s",
"ttft_mean_s", "vllm", "torch", "reserved_cpus"}``: output tokens over the wall time of the whole
``generate``, and the time to first token as the wall time of the same requests with one output
token (every request's first token); ``ttft_mean_s`` from vLLM's request metrics where it has them.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="a saved Hugging Face model directory")
    parser.add_argument("--prompts", required=True, help="JSON file of prompts as token-id lists")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + args.output_len
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=longest,
        max_num_seqs=max(len(prompts), 1),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=False,
        seed=0,
    )

    def params(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    # the timed runs once untimed, as `bench engine` rehearses its own engine: both sides timed past first use
    llm.generate(prompts, params(1), use_tqdm=False)
    llm.generate(prompts, params(args.output_len), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params(1), use_tqdm=False)
    ttft_batch = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts, params(args.output_len), use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = []
    for o in outputs:
        m = getattr(o, "metrics", None)
        first, arrival = getattr(m, "first_token_time", None), getattr(m, "arrival_time", None)
        if first is not None and arrival is not None:
            ttfts.append(first - arrival)
    print(
        json.dumps(
            {
                "output_tok_s": tokens / elapsed,
                "elapsed_s": elapsed,
                "output_tokens": tokens,
                "ttft_batch_s": ttft_batch,
                "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else None,
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "default"),
                "token_ids_head": [list(o.outputs[0].token_ids[:8]) for o in outputs[:2]],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
