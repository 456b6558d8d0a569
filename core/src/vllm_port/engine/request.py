"""A request as the scheduler tracks it: its tokens, its status, its blocks (device-free Python).

vLLM's vocabulary: ``token_ids`` are the prompt followed by the generated tokens;
``num_computed_tokens`` of them have their keys and values in the cache (the rest are computed by
the next steps: a prompt's chunks, or the one token sampled last); ``block_table`` lists the cache
blocks holding them in order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Protocol

from .sampling_params import SamplingParams

__all__ = ["FINISH_REASONS", "Request", "RequestStatus", "StopMatcher", "sample_seed"]

#: Why a request ended: a stop token or string (``"stop"``), ``max_tokens`` or the model's
#: length (``"length"``), a bad request (``"error"``, with a message), or the caller gave up (``"abort"``).
FINISH_REASONS = ("stop", "length", "error", "abort")


#: Spreads the seeds of a request's parallel samples (``SamplingParams.n``) far apart: an odd 63-bit
#: constant (the golden ratio's bits), so sample ``i``'s seeds never meet sample ``j``'s step seeds.
_SAMPLE_SEED_STRIDE = 0x1E3779B97F4A7C15


def sample_seed(seed: int, sample_index: int) -> int:
    """The seed of sample ``sample_index`` of a request whose seed is ``seed`` (sample 0 keeps ``seed``).

    A request with ``SamplingParams(n=3, seed=s)`` draws exactly what three requests with seeds
    ``sample_seed(s, 0)``, ``sample_seed(s, 1)`` and ``sample_seed(s, 2)`` draw alone.
    """
    return (seed + sample_index * _SAMPLE_SEED_STRIDE) % 2**63


class RequestStatus(enum.Enum):
    """Where a request is: queued (new or preempted by recompute), running, swapped out, or finished."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class StopMatcher(Protocol):
    """What watches a request's text for its stop strings: the engine's detokenizer, which the scheduler
    feeds (it never reads text itself, nor imports a tokenizer)."""

    def feed(self, token_id: int) -> bool:
        """Take the request's next output token; whether its text now holds a stop string."""
        ...


class Request:
    """One request's tokens, status and cache blocks.

    :param request_id: unique among the engine's requests.
    :param arrival: order of arrival (lower first); the scheduler serves requests in this order.
    :param prompt_token_ids: the prompt (at least one token).
    :param stop_token_ids: ids that end the request (the model's end-of-sequence ids unless
        ``ignore_eos``, and ``params.stop_token_ids``).
    :param seed: the request's sampling seed; step ``i``'s draw uses ``seed + i``.
    :param stop_matcher: fed each output token, answers whether a stop string has appeared in the
        text (``None``: no text is watched); the scheduler stops the request on its answer.
    """

    def __init__(
        self,
        request_id: str,
        arrival: int,
        prompt_token_ids: Iterable[int],
        params: SamplingParams,
        stop_token_ids: Iterable[int] = (),
        seed: int = 0,
        stop_matcher: StopMatcher | None = None,
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.stop_token_ids = frozenset(stop_token_ids)
        self.seed = seed
        self.stop_matcher = stop_matcher
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        #: blocks in swap space holding this request's cache while it is SWAPPED
        self.swap_table: list[int] = []
        #: content hashes of the first full blocks of ``token_ids`` (chained), filled as needed
        self.block_hashes: list[int] = []
        #: how many leading blocks of ``block_table`` are registered for prefix caching
        self.num_registered_blocks = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        #: which of its request's parallel samples this is (``SamplingParams.n``; 0 for the first)
        self.sample_index = 0
        #: the request's other samples, waiting to fork from this one once its prompt is computed:
        #: they share its full prompt blocks, get a copy of its partial last block, and draw their
        #: first token from the same logits with their own seeds (the prompt is computed once)
        self.forks: list[Request] = []
        #: prompt tokens found in the prefix cache when the request was first scheduled
        self.num_cached_tokens = 0
        #: ``params.bad_words`` as token ids (the engine's tokenizer makes them; the scheduler bans them)
        self.bad_words_token_ids: list[list[int]] = []

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt and generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def step_seed(self) -> int:
        """The seed of the draw that makes the next token: ``seed + tokens generated so far``.

        It depends on nothing but the request, so a request draws the same tokens whatever else is
        in the batch, and after a preemption.
        """
        return (self.seed + self.num_output_tokens) % 2**63

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // block_size)

    def append(self, token_id: int) -> None:
        """Add a generated token (its keys and values are computed by the next step)."""
        self.token_ids.append(token_id)
