"""``SamplingParams``: how one request samples and when it stops, checked when it is made (device-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["SamplingParams"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How a request samples its tokens and when it stops, as vLLM users know them.

    Attributes:
        temperature: 0 is greedy (argmax); higher flattens the distribution. Must be >= 0.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1], 1 keeps all.
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) keeps all. Must be >= -1.
        max_tokens: the most tokens to generate (>= 1); fewer when a stop condition comes first or
            the context reaches the model's length.
        stop: strings that end the request; the text stops before the first one generated.
        stop_token_ids: token ids that end the request (kept in the output, like end-of-sequence).
        seed: makes sampling reproducible: the same seed, prompt and parameters draw the same tokens
            on every run, whatever else is in the batch. ``None`` draws a fresh seed per request.
        ignore_eos: keep generating past the model's end-of-sequence tokens (benchmarks).

    :raises ValueError: for a value no request can run with; the message names the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field again (they may have been changed since construction).

        :raises ValueError: naming the field, its value and the allowed range.
        """
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature is {t!r}; it must be a finite number >= 0 (0 is greedy)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"SamplingParams.top_p is {p!r}; it must be in (0, 1] (1 keeps every token)")
        if not _is_int(k) or k < -1:
            raise ValueError(f"SamplingParams.top_k is {k!r}; it must be an int >= -1 (-1 or 0 keeps every token)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens is {self.max_tokens!r}; it must be an int >= 1")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop is {self.stop!r}; it must be a non-empty string or a list of them")
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"SamplingParams.stop_token_ids is {self.stop_token_ids!r}; it must be a list of ids >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed is {self.seed!r}; it must be None or an int in [0, 2**63)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"SamplingParams.ignore_eos is {self.ignore_eos!r}; it must be True or False")
        self._stop = tuple(stop)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        return self._stop

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token every step."""
        return self.temperature == 0
