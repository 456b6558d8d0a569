"""The engine's decode rate, measured one way by every benchmark that reports it.

A greedy ``generate`` of ``output_len`` tokens (EOS ignored) runs the prefill, which gives the first
token, and ``output_len - 1`` decode steps. A ``generate`` of one token on the same prompts runs the
prefill alone, so the difference of their wall times is the decode steps' time::

    warm_up(llm, prompts)                          # first use: kernels, allocations, captured graphs
    timing = time_decode(llm, prompts, output_len)  # a one-token run, then the whole run
    row = decode_rate(len(prompts), output_len, timing.decode_s)   # {"decode_tok_s": ..., "step_ms": ...}

Used by ``bench engine`` (its decode batches), ``bench importer`` (core against imported) and
``bench placement`` (which times the first run at a batch size apart and takes a median of repeats).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DecodeTiming", "decode_rate", "greedy", "time_decode", "warm_up"]

#: The least decode time a rate is computed from: a run whose one-token run took as long as it
#: (timer noise on a tiny model) reports a huge rate instead of dividing by zero.
_MIN_DECODE_S = 1e-9


def greedy(max_tokens: int) -> Any:
    """Greedy sampling of exactly ``max_tokens`` tokens (EOS ignored), so every run does the same steps."""
    from ..engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(llm: Any, prompts: Sequence[Any], *, num_prompts: int | None = None, max_tokens: int = 4) -> None:
    """A short greedy run of the first ``num_prompts`` prompts, so that first use is not timed.

    By default as many prompts as one step's token budget holds, and one more (at least 4): the run then makes
    every kind of step the timed runs make, a prefill, a mixed step (the first prompts' decode rows beside the
    next one's chunk) and decode steps, and the kernels each kind launches are compiled before the clock starts.
    On an H100 with a cold Triton cache, compiles inside the timed one-token run took 2 s of its 5.2.
    """
    if num_prompts is None:
        num_prompts = max(4, _one_step_and_one_more(prompts, llm.scheduler.config.max_num_batched_tokens))
    llm.generate(list(prompts[:num_prompts]), greedy(max_tokens), use_tqdm=False)


def _one_step_and_one_more(prompts: Sequence[Any], budget: int) -> int:
    """How many of the first prompts fill a step of ``budget`` tokens and spill into the next (all, if they
    don't); a prompt that is not token ids (text) counts as one token."""
    total = 0
    for i, prompt in enumerate(prompts):
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        total += len(ids) if isinstance(ids, (list, tuple)) else 1
        if total > budget:
            return i + 1
    return len(prompts)


@dataclass(frozen=True)
class DecodeTiming:
    """The wall times of a one-token run (the prefill) and of the whole run, and what the whole run returned."""

    prefill_s: float
    total_s: float
    outputs: Any

    @property
    def decode_s(self) -> float:
        """Seconds of the decode steps: the whole run less its prefill (may be <= 0 on a noisy tiny run)."""
        return self.total_s - self.prefill_s


def time_decode(
    llm: Any,
    prompts: Sequence[Any],
    output_len: int,
    *,
    whole_run: Callable[[Sequence[Any], Any], Any] | None = None,
) -> DecodeTiming:
    """Time a greedy run of one token, then of ``output_len`` tokens, on ``prompts``.

    :param whole_run: runs the whole run instead of ``llm.generate`` (called with the prompts and
        the sampling parameters), e.g. to stream it and time each request's first token.
    """
    start = time.perf_counter()
    llm.generate(prompts, greedy(1), use_tqdm=False)  # no progress bar in what is timed
    prefill_s = time.perf_counter() - start
    run = whole_run or (lambda batch, params: llm.generate(batch, params, use_tqdm=False))
    start = time.perf_counter()
    outputs = run(prompts, greedy(output_len))
    return DecodeTiming(prefill_s=prefill_s, total_s=time.perf_counter() - start, outputs=outputs)


def decode_rate(batch: int, output_len: int, decode_s: float) -> dict[str, float]:
    """``decode_tok_s`` (``batch`` sequences' decode tokens a second) and ``step_ms`` (milliseconds a step)."""
    steps = output_len - 1
    seconds = max(decode_s, _MIN_DECODE_S)
    return {"decode_tok_s": batch * steps / seconds, "step_ms": seconds / steps * 1e3}
