"""Where a vLLM step's time goes, with or without the bridge: self time per op, prefill and decode apart.

Run with vLLM's Python (the bridge's venv from ``dev/vllm-bridge-venv``; ``VLLM_PLUGINS=""`` for vLLM
alone, ``VLLM_PORT_CERTIFICATE`` and ``VLLM_PORT_PLUGINS=cpu`` for the bridge), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on a model directory and a JSON list of prompts' token ids:

    python probe_bridge_step.py MODEL PROMPTS.json OUT.json [--dtype float32]

After a warm-up it times a 64-token and a 1-token ``generate`` of every prompt unprofiled (their
difference over 63 is a decode step's wall time), then runs a 1-token and a 33-token ``generate``
under ``torch.profiler``. The first is the prefill alone; the second's self times less the first's,
over 32, are one decode step's. OUT.json holds both per op and a summary by part (GEMMs, attention,
cache write, compiled graph, bridged element-wise ops). Result: ``docs/results/bridge-cpu.md``,
"Prefill and decode apart, in process".
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from vllm import LLM, SamplingParams

#: profiler keys by part of a step (vLLM's own ops, the bridge's custom ops, the compiled graph's call)
PARTS = {
    "gemm": ("_C::onednn_mm",),
    "attention": ("_C::cpu_attention_with_kv_cache", "vllm::unified_attention_with_output"),
    "cache write": ("_C::cpu_attn_reshape_and_cache", "vllm::unified_kv_cache_update"),
    "compiled graph": ("## Call CompiledFxGraph None ##",),
    "bridged element-wise": (
        "vllm_port::fused_add_rms_norm__cpu__cpu_native_fused_add_rms_norm",
        "vllm_port::silu_and_mul__cpu__cpu_native_silu_and_mul",
        "vllm_port::rotary_embedding__cpu__cpu_native_rotary_embedding",
        "vllm_port::rms_norm__cpu__cpu_native_rms_norm",
    ),
}


def self_ms(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict[str, float]:
    """Self CPU time (ms) per profiler key over one ``generate``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    return {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = [{"prompt_token_ids": ids} for ids in json.load(f)]
    longest = max(len(p["prompt_token_ids"]) for p in prompts) + 64
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        max_model_len=longest,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        seed=0,
    )

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    llm.generate(prompts[:4], greedy(4), use_tqdm=False)
    llm.generate(prompts, greedy(16), use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, greedy(64), use_tqdm=False)
    t64 = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts, greedy(1), use_tqdm=False)
    t1 = time.perf_counter() - start

    prefill, whole = self_ms(llm, prompts, greedy(1)), self_ms(llm, prompts, greedy(33))
    decode = {k: (whole.get(k, 0.0) - prefill.get(k, 0.0)) / 32 for k in set(whole) | set(prefill)}
    by_part = {
        phase: {part: round(sum(times.get(k, 0.0) for k in keys), 2) for part, keys in PARTS.items()}
        | {"every op": round(sum(times.values()), 2)}
        for phase, times in (("prefill ms", prefill), ("decode ms per step", decode))
    }
    top = sorted(decode, key=decode.get, reverse=True)[:40]
    result = {
        "decode_step_ms_unprofiled": (t64 - t1) / 63 * 1e3,
        "generate_64_s": t64,
        "generate_1_s": t1,
        "parts": by_part,
        "decode_ms_per_step": {k: round(decode[k], 3) for k in top},
        "prefill_ms": {k: round(prefill.get(k, 0.0), 3) for k in top},
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"decode_step_ms_unprofiled": result["decode_step_ms_unprofiled"], **by_part}))


if __name__ == "__main__":
    main()
