"""The bench's one-token run ("all first tokens") timed again and again in one engine, beside the whole run.

    python3 dev/experiments/probe_one_token_runs.py MODEL_DIR [--no-split-too]

Issue 30: at b6f3ca4 `bench engine --h200` timed the one-token run of 256 x 512 prompts at 5.2-5.4 s on an H100 where
every earlier run took 3.2-3.4 s. This times that run three times after the bench's warm-up, then the whole run,
then the one-token run again, and says whether the time is a first-use cost or every run's.
"""

from __future__ import annotations

import sys
import time

import torch


def main() -> None:
    from vllm_port import LLM
    from vllm_port.bench._decode import greedy, warm_up

    model_dir = sys.argv[1]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128000, (512,), generator=gen).tolist() for _ in range(256)]
    llm = LLM(model_dir, dtype="bfloat16", max_model_len=768, max_num_seqs=256, enable_prefix_caching=False, seed=0)
    warm_up(llm, prompts)

    def timed(label: str, max_tokens: int) -> None:
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
        torch.cuda.synchronize()
        print(f"{label}: {time.perf_counter() - start:.3f} s", flush=True)

    for i in range(3):
        timed(f"one-token run {i + 1}", 1)
    timed("whole run (256 tokens)", 256)
    timed("one-token run after it", 1)
    if "--no-split-too" in sys.argv:
        import vllm_port.engine.runner as runner_module

        runner_module._leading_decode_rows = lambda query_lens: 0
        timed("one-token run, unsplit", 1)
        timed("whole run, unsplit", 256)
    llm.close()


if __name__ == "__main__":
    main()
