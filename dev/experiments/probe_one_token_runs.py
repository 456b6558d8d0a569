"""The bench's one-token run ("all first tokens") timed again and again, through the bench's own code and without it.

    python3 dev/experiments/probe_one_token_runs.py MODEL_DIR [--no-split-too]

Issue 30: at b6f3ca4 `bench engine --h200` timed the one-token run of 256 x 512 prompts at 5.2-6.6 s on an H100 where
every earlier run took 3.2-3.4 s, and where this probe's own engine, in the same call, took 3.3 s. This runs
``bench.engine.run_engine`` (the bench's flow: its prompts, its warm-up, a one-token run, the streamed whole run),
then one engine that times the one-token run three times, the whole run, and the one-token run again, then the
bench's flow once more; after each, the allocator's retries (a cudaMalloc that failed, the cache emptied, a sync)
and the device's free memory. Builds ``bench engine --h200``'s model into MODEL_DIR first if it holds none.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def allocator() -> str:
    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return (
        f"alloc retries {stats.get('num_alloc_retries', 0)}, device mallocs {stats.get('num_device_alloc', 0)}, "
        f"frees {stats.get('num_device_free', 0)}; free {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
    )


def main() -> None:
    from vllm_port import LLM
    from vllm_port.bench._decode import greedy, warm_up
    from vllm_port.bench.engine import make_prompts, run_engine
    from vllm_port.bench.engine_workload import H200_WORKLOAD, build_model, release_memory

    model_dir = Path(sys.argv[1])
    w = H200_WORKLOAD
    if not (model_dir / "config.json").exists():
        build_model(model_dir, w, device="cuda")
        print("built", model_dir, "|", allocator(), flush=True)
    prompts = make_prompts(w)

    def bench_flow(label: str) -> None:
        r = run_engine(model_dir, prompts, w, None)
        print(
            f"{label}: one-token run {r['ttft_batch_s']:.3f} s, whole run {r['elapsed_s']:.3f} s "
            f"({r['output_tok_s']:,.0f} tok/s) | {allocator()}",
            flush=True,
        )
        release_memory("cuda")

    bench_flow("bench's run_engine")
    llm = LLM(
        str(model_dir), dtype="bfloat16", max_model_len=768, max_num_seqs=256, enable_prefix_caching=False, seed=0
    )
    warm_up(llm, prompts)

    def timed(label: str, max_tokens: int) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        torch.cuda.synchronize()
        print(f"{label}: {time.perf_counter() - start:.3f} s | {allocator()}", flush=True)

    for i in range(3):
        timed(f"one-token run {i + 1}", 1)
    timed("whole run (256 tokens)", 256)
    timed("one-token run after it", 1)
    if "--no-split-too" in sys.argv:
        import vllm_port.engine.runner as runner_module

        split = runner_module._leading_decode_rows
        runner_module._leading_decode_rows = lambda query_lens: 0
        timed("one-token run, unsplit", 1)
        timed("whole run, unsplit", 256)
        runner_module._leading_decode_rows = split
    llm.close()
    release_memory("cuda")
    bench_flow("bench's run_engine again")


if __name__ == "__main__":
    main()
