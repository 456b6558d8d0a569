"""``SamplingParams``: how one request samples and when it stops, checked when it is made (device-free)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

__all__ = ["INT64_MAX", "MIN_TEMPERATURE", "SamplingParams"]

#: The largest int the step's int64 metadata carries (``top_k``, seeds, token ids).
INT64_MAX = 2**63 - 1
#: The smallest temperature above 0 that sampling takes: the sampler divides float32 logits by the
#: temperature, and below this ordinary logits (tens) would overflow float32 to infinity.
MIN_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_float32(value: float) -> float:
    """``value`` as the sampler's float32 holds it (``inf`` when it does not fit)."""
    try:
        return float(struct.unpack("f", struct.pack("f", value))[0])
    except OverflowError:
        return math.inf


def _is_unicode(text: str) -> bool:
    """Whether ``text`` is valid Unicode (no lone surrogate, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    """How a request samples its tokens and when it stops, as vLLM users know them.

    Attributes:
        temperature: 0 is greedy (argmax); higher flattens the distribution. Must be 0 or in
            [:data:`MIN_TEMPERATURE`, float32's largest finite value].
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1], 1 keeps all.
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) keeps all. An int in [-1, 2**63 - 1]
            (the step carries it as int64; above the vocabulary it keeps all).
        max_tokens: the most tokens to generate (an int in [1, 2**63 - 1]); fewer when a stop condition
            comes first or the context reaches the model's length.
        stop: strings that end the request (valid Unicode); the text stops before the first one generated.
        stop_token_ids: token ids that end the request (kept in the output, like end-of-sequence), in [0, 2**63 - 1].
        seed: makes sampling reproducible: the same seed, prompt and parameters draw the same tokens
            on every run, whatever else is in the batch. ``None`` draws a fresh seed per request.
        ignore_eos: keep generating past the model's end-of-sequence tokens (benchmarks).
        n: how many samples to draw for the prompt (an int >= 1): each ``RequestOutput`` then holds
            ``n`` completions. The prompt is computed once and its KV blocks are shared by the samples
            (copy-on-write); sample ``i`` draws with its own seed, derived from ``seed`` and ``i``
            (:func:`vllm_port.engine.request.sample_seed`), so a seeded request's samples are
            reproducible and distinct.
        include_stop_str_in_output: keep the stop string that ended the text in it (default: the
            text ends just before it).
        skip_special_tokens: leave special tokens (``<s>``, ``</s>``, ...) out of the text (the token
            ids keep them).

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
    n: int = 1
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field again (they may have been changed since construction).

        :raises ValueError: naming the field, its value and the allowed range.
        """
        t, p, k = self.temperature, self.top_p, self.top_k
        if not _is_number(t) or not (t == 0 or (MIN_TEMPERATURE <= t and math.isfinite(_as_float32(t)))):
            raise ValueError(
                f"SamplingParams.temperature is {t!r}; it must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                "3.4e38] (the sampler divides float32 logits by it)"
            )
        if not _is_number(p) or not 0 < p <= 1 or _as_float32(p) == 0:
            raise ValueError(
                f"SamplingParams.top_p is {p!r}; it must be in (0, 1] and above 0 in float32 (1 keeps every token)"
            )
        if not _is_int(k) or not -1 <= k <= INT64_MAX:
            raise ValueError(
                f"SamplingParams.top_k is {k!r}; it must be an int in [-1, 2**63 - 1] (-1 or 0 keeps every token)"
            )
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"SamplingParams.max_tokens is {self.max_tokens!r}; it must be an int in [1, 2**63 - 1]")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s and _is_unicode(s) for s in stop):
            raise ValueError(
                f"SamplingParams.stop is {self.stop!r:.200}; it must be a non-empty string of valid Unicode (no lone "
                "surrogates) or a list of them"
            )
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and 0 <= i <= INT64_MAX for i in ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids is {self.stop_token_ids!r:.200}; it must be a list of ids in "
                "[0, 2**63 - 1]"
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            raise ValueError(f"SamplingParams.seed is {self.seed!r}; it must be None or an int in [0, 2**63 - 1]")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n is {self.n!r}; it must be an int >= 1 (samples drawn for the prompt)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} is {getattr(self, name)!r}; it must be True or False")
        self._stop = tuple(stop)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        return self._stop

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token every step."""
        return self.temperature == 0
