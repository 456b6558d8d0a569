"""``Logprob``: one token's log-probability in a request's output, as vLLM's (device-free)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Logprob"]


@dataclass
class Logprob:
    """The log-probability of one token at one position, of the model's raw logits (before penalties).

    Attributes:
        logprob: ``log_softmax`` of the position's logits at this token, computed in float32.
        rank: 1 for the most likely token; 1 + the number of tokens more likely than this one.
        decoded_token: the token's text (``None`` without a tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
