"""The engine's host work a decode step, at the GPU benchmark's batch sizes, with the model taken out.

    .venv/bin/python dev/experiments/probe_host_step.py [--batches 64,256] [--profile 256]

The engine runs ``bench engine --h200``'s requests (``--prompt`` random tokens each, ``--output`` greedy
tokens) on a tiny random Llama whose step is replaced by a no-op that hands back a preallocated logits
buffer. What is left of a step is the host's work: scheduling, the runner's inputs, sampling the tiny logits,
updating the requests and streaming their deltas. On a GPU that work must hide behind the device's step
(asynchronous scheduling); where it takes longer, the step is host-bound (issue 30: at 256 sequences the
engine's decode step took 18.7 ms on an H100 where its captured graph replays in 14.7 ms).

Prints, per batch, the decode phase's host milliseconds a step (the run minus its one-token run, over the
remaining steps); ``--profile B`` adds cProfile's top functions of the run at batch ``B``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch


def build(path: str, vocab: int) -> None:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def run(model: str, batch: int, prompt: int, output: int, vocab: int, block_size: int, profile: bool) -> float:
    from vllm_port import LLM, SamplingParams

    logits = torch.zeros(batch, vocab)

    def make_step(runner):
        def step(input_ids, positions, kv_caches, meta, logits_rows):
            return logits[: len(logits_rows)]

        return step

    llm = LLM(
        model,
        dtype="float32",
        max_model_len=prompt + output,
        max_num_seqs=batch,
        block_size=block_size,
        enable_prefix_caching=False,
        seed=0,
        make_step=make_step,
        kv_cache_memory=batch * (prompt + output) * 64 * 4 * 4,
    )
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (prompt,), generator=gen).tolist()} for _ in range(batch)]

    def timed(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for _ in llm.stream(prompts, params):
            pass
        return time.perf_counter() - start

    try:
        timed(2)
        first = timed(1)
        profiler = cProfile.Profile() if profile else None
        if profiler:
            profiler.enable()
        whole = timed(output)
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        return (whole - first) / (output - 1) * 1e3
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=512, help="small: the logits' sampling is device work on a GPU")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--profile", type=int, default=0, help="a batch to run under cProfile too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as model:
        build(model, args.vocab)
        for batch in [int(b) for b in args.batches.split(",")]:
            ms = run(model, batch, args.prompt, args.output, args.vocab, args.block_size, False)
            print(f"batch {batch:4d}: host {ms:6.2f} ms a decode step (model taken out)", flush=True)
        if args.profile:
            run(model, args.profile, args.prompt, args.output, args.vocab, args.block_size, True)


if __name__ == "__main__":
    main()
