"""Device time of a step's sampling at Llama-3's vocabulary (issue 30): what a sampled (not greedy) step pays.

The engine takes the argmax itself when every row is greedy; a step with any sampled row calls the bound
``sample`` provider, whose Triton path sorts every row's whole vocabulary to find what top-k/top-p keep unless
the caller passes ``top_k`` and ``top_p`` as ``None`` (no row truncates: what the engine passes for vLLM's default
``SamplingParams``). This times, with the L2 flushed (``triton.testing.do_bench``), at 1, 64 and 256 rows of
128,256 bf16 logits:

- greedy: what the engine runs for all-greedy steps (widen, sum for the finite flags, argmax);
- sample, temperature 1 and nothing truncated, as tensors (``top_k`` 0, ``top_p`` 1: the sort runs) and as
  ``None`` (no sort); the same with top-p 0.9 and top-k 50;
- the stable sort alone, of the rows' float32 scores.

    python3 dev/experiments/probe_sample_cost.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton.testing import do_bench

from vllm_port.runtime import load

VOCAB = 128_256


def _cases(sample: Callable[..., torch.Tensor], rows: int) -> dict[str, Callable[[], object]]:
    """What a step of ``rows`` sequences runs to pick its tokens, each way timed."""
    logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16) * 4
    ones = torch.ones(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
    no_k = torch.zeros(rows, device="cuda", dtype=torch.int32)
    top_k, top_p = no_k + 50, ones * 0.9

    def greedy() -> torch.Tensor:
        wide = logits.float()
        wide.sum(dim=-1).isfinite()
        return wide.argmax(dim=-1)

    return {
        "greedy (the engine's own argmax)": greedy,
        "sample, T=1, top-k 0, top-p 1": lambda: sample(logits, ones, no_k, ones, seeds),
        "sample, T=1, top-k/top-p None": lambda: sample(logits, ones, None, None, seeds),
        "sample, T=1, top-p 0.9, top-k 50": lambda: sample(logits, ones, top_k, top_p, seeds),
        "stable sort of the float32 scores": lambda: logits.float().sort(dim=-1, descending=True, stable=True),
    }


def main() -> None:
    runtime = load(device="cuda")
    chosen = runtime.bind(torch.bfloat16).providers["sample"]
    print(f"sample provider: {chosen.name}")
    for rows in (1, 64, 256):
        for label, fn in _cases(chosen.fn, rows).items():
            ms = do_bench(fn, warmup=25, rep=200)
            print(f"rows {rows:4d}  {label:36s} {ms:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
