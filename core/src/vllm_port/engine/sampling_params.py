"""``SamplingParams``: how one request samples and when it stops, checked when it is made (device-free)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

__all__ = ["INT64_MAX", "MAX_LOGIT_BIAS", "MAX_LOGPROBS", "MIN_TEMPERATURE", "SamplingParams"]

#: The largest int the step's int64 metadata carries (``top_k``, seeds, token ids).
INT64_MAX = 2**63 - 1
#: The smallest temperature above 0 that sampling takes: the sampler divides float32 logits by the
#: temperature, and below this ordinary logits (tens) would overflow float32 to infinity.
MIN_TEMPERATURE = 1e-5
#: The most top logprobs a request may ask for per token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: A ``logit_bias`` value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range); outside it is refused.
MAX_LOGIT_BIAS = 100.0


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
        presence_penalty: subtracted from the logit of every token already in the output; in [-2, 2].
        frequency_penalty: subtracted from a token's logit once per time it is in the output; in [-2, 2].
        repetition_penalty: tokens in the prompt or the output have positive logits divided by it and
            negative ones multiplied by it; > 0 (1: none).
        min_p: drop tokens whose probability is below ``min_p`` times the most likely token's; in [0, 1].
        min_tokens: until this many tokens are generated, the stop tokens (end-of-sequence and
            ``stop_token_ids``) cannot be drawn and stop strings do not end the request; in [0, max_tokens].
        logit_bias: token id -> value added to its logit before sampling, each in [-100, 100]
            (outside is refused); ids are checked against the vocabulary when the request is submitted.
        allowed_token_ids: only these tokens can be drawn (non-empty; ids checked at submission).
        bad_words: words never generated (needs the tokenizer): a one-token word is never drawn, a
            longer one's last token is banned right after its other tokens were generated.
        logprobs: return the logprobs of this many most likely tokens at each generated position, and
            the drawn token's own (in [0, 20]; None: none).
        prompt_logprobs: the same for each prompt token after the first (in [0, 20]; None: none).

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    _stop: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _processes: bool = field(default=False, init=False, repr=False, compare=False)

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
        self._validate_processing()

    def _validate_processing(self) -> None:
        """The logits processors and logprobs (vLLM's names and ranges)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"SamplingParams.{name} is {value!r}; it must be a number in [-2, 2] (0: none)")
        r = self.repetition_penalty
        if not _is_number(r) or not (0 < r and math.isfinite(r)) or _as_float32(r) == 0:
            raise ValueError(f"SamplingParams.repetition_penalty is {r!r}; it must be a finite number > 0 (1: none)")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p is {self.min_p!r}; it must be a number in [0, 1] (0: none)")
        m = self.min_tokens
        if not _is_int(m) or not 0 <= m <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens is {m!r}; it must be an int in [0, max_tokens] (max_tokens is "
                f"{self.max_tokens})"
            )
        bias = self.logit_bias
        if bias is not None and (
            not isinstance(bias, dict)
            or not all(_is_int(k) and k >= 0 for k in bias)
            or not all(_is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for v in bias.values())
        ):
            raise ValueError(
                f"SamplingParams.logit_bias is {bias!r:.200}; it must be a dict of int token ids >= 0 to numbers in "
                f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}] (values outside are refused, not clamped)"
            )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, (list, tuple)) or not allowed or not all(_is_int(i) and i >= 0 for i in allowed)
        ):
            raise ValueError(
                f"SamplingParams.allowed_token_ids is {allowed!r:.200}; it must be a non-empty list of int token ids "
                ">= 0 (None allows every token)"
            )
        words = self.bad_words
        if words is not None and (
            not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w and _is_unicode(w) for w in words)
        ):
            raise ValueError(
                f"SamplingParams.bad_words is {words!r:.200}; it must be a list of non-empty strings of valid Unicode"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"SamplingParams.{name} is {value!r}; it must be None or an int in [0, {MAX_LOGPROBS}] (how many "
                    "of the most likely tokens to return; 0: only the chosen one)"
                )

        self._processes = bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.min_p
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
        )

    @property
    def processes_logits(self) -> bool:
        """Whether the request needs its logits processed before the draw (penalties, min_p, biases, bans).

        As of the last :meth:`validate` (construction, and ``generate`` checks every request again).
        """
        return self._processes

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty when unset)."""
        return self._stop

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token every step."""
        return self.temperature == 0
