"""``vllm-port bench engine --mixed-requests N``: a mixed workload's inter-token latency, prefill steps replayed or eager.

Every request is submitted at once with prompt and output lengths drawn from a fixed-seed lognormal
distribution (long-tailed: most requests short, a few ten times the median), so requests finish at
different steps and new ones join running decodes all through the run: most steps mix decode rows
with prefill chunks. The engine runs the same requests twice in one process, once replaying captured
graphs for prefill and mixed steps as well as decode steps (the default) and once replaying decode
steps only (``ModelRunner.replay_prefill = False``), each after an untimed run of the same requests in
both modes (the same steps, so no timed step is the first of its shape), and reports for each: output tok/s, the time
to first token and the gaps between a request's consecutive outputs (inter-token latency, ITL) at
p50 and p99, and how many steps ran replayed or eager.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["mixed_lengths", "render", "run_mixed"]

#: the lognormal's sigma: p99 is about 10x the median (e ** (2.33 * sigma))
SIGMA = 1.0


def mixed_lengths(num_requests: int, prompt_len: int, output_len: int, seed: int = 0) -> list[tuple[int, int]]:
    """``(prompt tokens, output tokens)`` per request: medians a quarter of ``prompt_len``/``output_len``, at most twice them."""
    rng = random.Random(seed)  # noqa: S311 - benchmark lengths, not secrets

    def draw(typical: int, low: int) -> int:
        median = max(typical / 4, 1.0)
        return int(min(max(round(rng.lognormvariate(math.log(median), SIGMA)), low), 2 * typical))

    return [(draw(prompt_len, 4), draw(output_len, 1)) for _ in range(num_requests)]


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _spread(values: Sequence[int]) -> list[float]:
    """``[min, median, max]``."""
    return [min(values), _percentile(values, 50), max(values)]


def _one_run(llm: Any, prompts: list[list[int]], params: list[Any]) -> dict[str, Any]:
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    gaps: list[float] = []
    tokens = 0
    before = dict(llm.runner.steps_by_kind)
    start = time.perf_counter()
    for delta in llm.stream(prompts, params):
        now = time.perf_counter()
        if not delta.token_ids:
            continue
        tokens += len(delta.token_ids)
        if delta.index in last:
            gaps.append(now - last[delta.index])
        else:
            first[delta.index] = now - start
        last[delta.index] = now
    elapsed = time.perf_counter() - start
    steps = {k: v - before.get(k, 0) for k, v in llm.runner.steps_by_kind.items()}
    return {
        "output_tok_s": tokens / elapsed if elapsed > 0 else float("nan"),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "ttft_p50_s": _percentile(list(first.values()), 50),
        "ttft_p99_s": _percentile(list(first.values()), 99),
        "itl_p50_ms": 1e3 * _percentile(gaps, 50),
        "itl_p99_ms": 1e3 * _percentile(gaps, 99),
        "itl_mean_ms": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
        "steps": {k: v for k, v in steps.items() if v},
    }


def run_mixed(
    model_dir: Path,
    vocab_size: int,
    dtype: str,
    num_requests: int,
    prompt_len: int,
    output_len: int,
    device: str | None,
    seed: int = 0,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """The mixed workload through one engine, prefill steps replayed and then eager; the results of both."""
    from ..engine import LLM, SamplingParams

    lengths = mixed_lengths(num_requests, prompt_len, output_len, seed)
    rng = random.Random(seed + 1)  # noqa: S311 - benchmark prompts, not secrets
    prompts = [[rng.randrange(5, vocab_size) for _ in range(p)] for p, _ in lengths]
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    llm = LLM(
        str(model_dir),
        device=device or "auto",
        dtype=dtype,
        max_model_len=2 * (prompt_len + output_len),
        enable_prefix_caching=False,  # random prompts share nothing
        seed=seed,
        **llm_kwargs,
    )
    try:
        modes = {"prefill replayed": True, "decode replayed only": False}
        # each mode's run once untimed, its only warm-up: every shape it meets (kernels, oneDNN's primitives) seen once
        for replay_prefill in modes.values():
            llm.runner.replay_prefill = replay_prefill
            _one_run(llm, prompts, params)
        runs = {}
        for name, replay_prefill in modes.items():
            llm.runner.replay_prefill = replay_prefill
            runs[name] = _one_run(llm, prompts, params)
        return {
            "num_requests": num_requests,
            "prompt_tokens": _spread([p for p, _ in lengths]),
            "output_tokens": _spread([o for _, o in lengths]),
            "captured_batch_sizes": llm.captured_batch_sizes,
            "max_num_batched_tokens": llm.scheduler.config.max_num_batched_tokens,
            "runs": runs,
        }
    finally:
        llm.close()


def render(mixed: dict[str, Any]) -> list[str]:
    """The mixed workload's table (Markdown lines)."""
    p, o = mixed["prompt_tokens"], mixed["output_tokens"]
    sizes = mixed["captured_batch_sizes"]
    capture = f"captured sizes {sizes[0]}..{sizes[-1]} rows" if sizes else "no graph capture"
    lines = [
        "",
        f"mixed workload: {mixed['num_requests']} requests at once, lognormal lengths (prompt {p[0]}/{p[1]}/{p[2]}, "
        f"output {o[0]}/{o[1]}/{o[2]} tokens: min/median/max), greedy; {mixed['max_num_batched_tokens']} tokens a "
        f"step; {capture}",
        "",
        "| steps replayed | output tok/s | ITL p50 (ms) | ITL p99 (ms) | TTFT p50 (s) | TTFT p99 (s) | steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, r in mixed["runs"].items():
        steps = ", ".join(f"{v} {k}" for k, v in sorted(r["steps"].items()))
        lines.append(
            f"| {name} | {r['output_tok_s']:,.0f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
            f"{r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | {steps} |"
        )
    return lines
