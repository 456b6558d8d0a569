"""The scheduler: which requests run each step, with how many tokens, in which cache blocks (device-free Python).

Each step has a budget of tokens (``max_num_batched_tokens``). Every request computes the tokens it
has that are not in the cache yet, ``num_tokens - num_computed_tokens``: a whole prompt, a chunk of
one (chunked prefill: a prompt longer than what is left of the budget is split over steps), the one
token sampled last (decode), or everything again after a preemption by recompute. One rule serves
all of them, so prefill and decode requests share a step (continuous batching).

Order, first come first served, with no starvation:

1. Running requests, earliest arrival first, each takes its tokens from the budget. One that needs
   a block the pool does not have asks the reclaimer (:mod:`vllm_port.reclaimer`), whose candidates
   are the running requests not yet served this step, itself included: the default preempts the
   latest arrivals, so the earliest request always advances.
2. Then, if nobody was preempted this step, waiting requests in arrival order (preempted ones
   rejoin the queue at their arrival's place, so they come before every later request): swapped
   requests are swapped back in; others look their full prompt blocks up in the prefix cache and
   start after the hits. The first that does not fit (blocks, budget, ``max_num_seqs``) stops the
   admissions: nobody overtakes it.

Parallel samples (``SamplingParams.n``): only a request's first sample is queued; the others wait
on it (``Request.forks``). The step that completes its prompt samples one row of logits once per
sample, each with its own seed, and then forks each other sample from it: the full prompt blocks are
shared (one more reference each, ``BlockPool.fork``), the partial last block is copied into a block
of its own (``StepBatch.copies``, made at the start of the next step, before anything writes).
A sample that finds no block or no room among ``max_num_seqs`` waits instead, as one preempted by
recompute (its prompt's full blocks then come back from the prefix cache, when it is on).

The pool is the platform's block pool (:class:`vllm_port.kv_pool.BlockPool`'s interface); swap space
is a second pool, of the swap tier. Prefix caching registers each block once its tokens are
computed, chained by content hash; blocks of finished or preempted requests stay cached-free until
they are evicted. The pool owns which blocks are cached-free and in which order they go: the
scheduler asks it (``cached_blocks``) and evicts through it (``evict``), keeping no books of its own.
While cached blocks can cover a need, only cached blocks are offered to the reclaimer (running work
is never lost to keep a cache).

Stopping is decided in one place, :meth:`Scheduler.update`, as each sampled token is appended: a
stop token or a stop string in its text, then the request's length (``max_tokens``, ``max_model_len``).
The text is not the scheduler's to read: the request carries a :class:`~.request.StopMatcher`
(the engine's detokenizer), fed every output token, that answers whether a stop string has appeared.
Before ``min_tokens`` output tokens only ``max_model_len`` ends a request (the stop tokens are banned
from the draw meanwhile: :class:`RowProcessing`).

The step batch carries what the sampler needs beyond temperature, top-k and top-p only for the
requests that ask for it: each such row's :class:`RowProcessing` (penalties, ``min_p``, biases, the
tokens banned this step by ``min_tokens`` and ``bad_words``), the rows that want logprobs, and the
prompt tokens whose logprobs a step's positions predict. A request with ``prompt_logprobs`` takes
nothing from the prefix cache (its cached positions would have no logits): it recomputes its prompt.

Asynchronous scheduling (``LLM(async_scheduling=True)``) schedules step N+1 while step N runs:
:meth:`Scheduler.commit` advances step N's sequences before their tokens are known, each sampling
one holding a :data:`PLACEHOLDER` as its last token, which the runner fills on the device from step
N's sampled ids; ``update(..., committed=True)`` writes the tokens in their place once they are read,
and stops the requests that end there (a row scheduled for one of them in step N+1 is dropped).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from ..errors import MemoryContractError
from ..reclaimer import MemoryPressure, Reclaimer, RequestFacts, check_plan
from .request import Request, RequestStatus

__all__ = [
    "PLACEHOLDER",
    "RowProcessing",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepBatch",
    "StepResult",
    "TokenError",
    "TopLogprobs",
]


#: The last token of a sequence whose sampled token the host has not read yet (asynchronous scheduling):
#: never a vocabulary id, never given to the model (the runner writes the sampled id in its place).
PLACEHOLDER = -1


@dataclass(frozen=True)
class TokenError:
    """A sampling row of a step that produced no token: the runner returns it in the token's place.

    Attributes:
        message: what went wrong (the step, the row's logits or id, who is at fault, how to find or fix it).
        cache_suspect: the request's KV cache may hold the same bad values (NaN or Inf from the
            forward): its blocks are not kept for prefix caching, so no later request reads them.
    """

    message: str
    cache_suspect: bool = False


@dataclass(frozen=True)
class RowProcessing:
    """What the ``process_logits`` op needs for one sampling row (only rows whose request asks for it).

    Attributes:
        repetition_penalty, frequency_penalty, presence_penalty, min_p: the request's.
        logit_bias: token id -> value added to its logit.
        allowed_token_ids: only these may be drawn (``None``: all).
        banned_token_ids: ids that cannot be drawn this step: the stop tokens while fewer than
            ``min_tokens`` are generated, and the bad words' tokens that would complete one.
        prompt_token_ids: the prompt, for the repetition penalty (empty when it is 1).
        output_token_ids: the tokens generated so far, for the penalties (empty when they are all off).
    """

    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias: dict[int, float]
    allowed_token_ids: tuple[int, ...] | None
    banned_token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, seq: Request) -> RowProcessing:
        """The processing of ``seq``'s next token, from its parameters and what it generated so far."""
        p = seq.params
        output = seq.output_token_ids
        banned = [*seq.stop_token_ids] if seq.num_output_tokens < p.min_tokens else []
        for word in seq.bad_words_token_ids:  # banned at its last token once the others were just generated
            if len(word) <= len(output) + 1 and output[len(output) - len(word) + 1 :] == word[:-1]:
                banned.append(word[-1])
        penalised = p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
        return cls(
            float(p.repetition_penalty),
            float(p.frequency_penalty),
            float(p.presence_penalty),
            float(p.min_p),
            dict(p.logit_bias or {}),
            tuple(p.allowed_token_ids) if p.allowed_token_ids else None,
            tuple(banned),
            tuple(seq.prompt_token_ids) if p.repetition_penalty != 1 else (),
            tuple(output) if penalised else (),
        )


@dataclass(frozen=True)
class TopLogprobs:
    """Logprobs at one position: the chosen (or given) token's, its rank (1: the most likely), and the top ones.

    ``top`` holds ``(token id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


class StepResult(list):  # type: ignore[type-arg]
    """A step's sampled tokens (the list :meth:`Scheduler.update` takes), with the logprobs rows asked for.

    Attributes:
        logprobs: sampling row (position in ``sample_rows``) -> the drawn token's :class:`TopLogprobs`.
        prompt_logprobs: scheduled sequence index -> ``(position of the prompt token, its TopLogprobs)``
            for every prompt token this step's logits predict.
    """

    def __init__(self, tokens: Any = (), logprobs: Any = None, prompt_logprobs: Any = None) -> None:
        super().__init__(tokens)
        self.logprobs: dict[int, TopLogprobs] = dict(logprobs or {})
        self.prompt_logprobs: dict[int, list[tuple[int, TopLogprobs]]] = dict(prompt_logprobs or {})


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of the scheduler.

    Attributes:
        max_model_len: the longest context a request may reach (prompt and output); the pool must hold it.
        max_num_seqs: the most requests running at once.
        max_num_batched_tokens: the token budget of one step; longer prompts are chunked.
        enable_prefix_caching: reuse cached blocks of equal prompt prefixes.
    """

    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} is {value!r}; it must be an int >= 1")


@dataclass
class StepBatch:
    """One step as plain lists, all the runner needs to build its tensors (picklable: ranks receive it).

    Attributes:
        input_ids, positions, slot_mapping: per token of the step, sequence after sequence.
        block_tables, seq_lens, query_lens: per scheduled sequence (``seq_lens`` counts the cached
            tokens plus this step's).
        sample_rows: index (into the scheduled sequences) of each sequence that samples a token this
            step (it reaches its last known token); the sampling lists are per such row.
        swap_out: ``(device block, swap block)`` copies to make before the step; ``swap_in``:
            ``(swap block, device block)``, made after the swap-outs.
        copies: ``(device block, device block)`` copies to make first of all: the partial last
            blocks of forked samples (``SamplingParams.n``).
        processing: sampling row -> its :class:`RowProcessing`, for the requests with logits
            processors (penalties, min_p, biases, bans); empty in a step without any.
        logprobs: sampling row -> how many top logprobs its request asks for (empty: none).
        prompt_logprobs: scheduled sequence -> how many top logprobs its request asks for at each prompt
            position, and the prompt tokens this step's positions predict (the first position's is the
            token after it); empty: none.
    """

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_ps: list[float] = field(default_factory=list)
    top_ks: list[int] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    processing: dict[int, RowProcessing] = field(default_factory=dict)
    logprobs: dict[int, int] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[int]]] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token (``paged_attention`` serves the step)."""
        return bool(self.query_lens) and all(n == 1 for n in self.query_lens)


@dataclass
class SchedulerOutput:
    """What one step runs: the sequences with their new token counts, block copies, and who was preempted."""

    seqs: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    #: per scheduled sequence, whether it samples: set by :meth:`Scheduler.commit` (``None``: not committed)
    committed: list[bool] | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to copy."""
        return not self.seqs and not self.swap_out and not self.swap_in and not self.copies

    def samples(self, index: int) -> bool:
        """Whether scheduled sequence ``index`` reaches its last known token this step (and so samples)."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens

    def batch(self, block_size: int) -> StepBatch:
        """The step as a :class:`StepBatch` (call before :meth:`Scheduler.update` advances the sequences)."""
        b = StepBatch(swap_out=list(self.swap_out), swap_in=list(self.swap_in), copies=list(self.copies))
        for i, (seq, n) in enumerate(zip(self.seqs, self.num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            b.input_ids += seq.token_ids[start:end]
            b.positions += range(start, end)
            b.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            b.block_tables.append(table)
            b.seq_lens.append(end)
            b.query_lens.append(n)
            p = seq.params
            if p.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:  # the tokens its positions predict
                b.prompt_logprobs[i] = (
                    p.prompt_logprobs,
                    seq.token_ids[start + 1 : min(end, seq.num_prompt_tokens - 1) + 1],
                )
            if end == seq.num_tokens:
                for sample in (seq, *seq.forks):  # samples waiting to fork draw from the same logits
                    p = sample.params
                    if p.processes_logits:
                        b.processing[len(b.sample_rows)] = RowProcessing.of(sample)
                    if p.logprobs is not None:
                        b.logprobs[len(b.sample_rows)] = p.logprobs
                    b.sample_rows.append(i)
                    b.temperatures.append(float(p.temperature))
                    b.top_ps.append(float(p.top_p))
                    b.top_ks.append(max(p.top_k, 0))
                    b.seeds.append(sample.step_seed)
        return b


class Scheduler:
    """Continuous batching over a block pool; see the module docstring for the policy.

    :param pool: the device KV cache's block pool.
    :param reclaimer: the policy asked when the pool runs short (``Runtime.reclaimer()``).
    :param swap_pool: the swap space's block pool, or ``None`` without swap space.
    :param reclaimer_name: who the reclaimer is, for error messages (its plugin).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        pool: Any,
        reclaimer: Reclaimer,
        swap_pool: Any = None,
        reclaimer_name: str = "reclaimer",
    ) -> None:
        capacity = pool.num_blocks * pool.block_size
        if config.max_model_len > capacity:
            raise MemoryContractError(
                f"max_model_len {config.max_model_len} exceeds the KV cache's {capacity} tokens "
                f"({pool.num_blocks} blocks of {pool.block_size}); raise the KV-cache memory or lower max_model_len"
            )
        self.config = config
        self.pool = pool
        self.swap_pool = swap_pool
        self.reclaimer = reclaimer
        self.reclaimer_name = reclaimer_name
        self.block_size: int = pool.block_size
        self.waiting: list[Request] = []  # in arrival order
        self.running: list[Request] = []  # in arrival order
        #: preemptions so far, and how many of them swapped (the rest recomputed)
        self.num_preemptions = 0
        self.num_swapped = 0
        #: partial blocks of samples forked by the last update, to copy before the next step writes:
        #: ``(sample, source block, its own block)``
        self._fork_copies: list[tuple[Request, int, int]] = []

    # --- requests ----------------------------------------------------------------------------------

    def add(self, seq: Request) -> None:
        """Queue a new request (its prompt already checked by the engine)."""
        seq.status = RequestStatus.WAITING
        bisect.insort(self.waiting, seq, key=_arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Request, reason: str, error: str | None = None, *, keep_prefix: bool = True) -> None:
        """End ``seq`` (any status): its blocks go back to the pools (prefix blocks stay cached, unless not ``keep_prefix``).

        Samples still waiting to fork from ``seq`` end with it.
        """
        if seq.is_finished:
            return
        if seq.token_ids[-1:] == [PLACEHOLDER]:  # its token was not read yet: dropped, as a sync step drops it
            seq.token_ids.pop()
        for sample in seq.forks:
            self.finish(sample, reason, error)
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        else:
            self._unqueue(seq)
        if not keep_prefix:
            self._forget_prefix(seq)
        self._release(seq)
        if seq.swap_table:
            self.swap_pool.free(seq.swap_table)
            seq.swap_table = []
        seq.status = RequestStatus.FINISHED
        seq.finish_reason, seq.error = reason, error

    def _unqueue(self, seq: Request) -> None:
        """Take ``seq`` out of the waiting queue if it is there, by a binary search on its arrival.

        Closing a stream of thousands of queued requests then costs that many searches, not scans.
        """
        waiting = self.waiting
        i = bisect.bisect_left(waiting, seq.arrival, key=_arrival)
        while i < len(waiting) and waiting[i].arrival == seq.arrival:
            if waiting[i] is seq:
                del waiting[i]
                return
            i += 1

    # --- one step ----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's sequences and token counts; allocate, preempt and swap as needed."""
        out = SchedulerOutput()
        # before anything this step allocates can be written: samples since ended or preempted need no copy
        out.copies = [(src, dst) for sample, src, dst in self._fork_copies if dst in sample.block_table]
        self._fork_copies = []
        budget = self.config.max_num_batched_tokens
        running = list(self.running)
        for i, seq in enumerate(running):
            if budget == 0:
                break
            if seq.status is not RequestStatus.RUNNING:  # preempted for an earlier request this step
                continue
            if seq.token_ids[-1] == PLACEHOLDER and self._ends_by_length(seq):
                continue  # committed ahead with its last token: it ends when that token is read, and needs no step
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._grow(seq, seq.num_computed_tokens + n, running[i:], out):
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def commit(self, out: SchedulerOutput, batch: StepBatch) -> None:
        """Advance the step's sequences before its tokens are known (asynchronous scheduling).

        Each sequence counts this step's tokens as computed, and each sampling one takes a
        :data:`PLACEHOLDER` for the token it samples, so the next :meth:`schedule` gives it the step
        after; ``update(out, tokens, committed=True)`` puts the tokens in the placeholders' place.
        Only for steps without forks (the engine checks: ``SamplingParams.n == 1``); ``batch`` is the step's
        batch as launched.
        """
        # the step's sampling rows as launched (``batch``): a request ended since (an error in the step before, an
        # abort) no longer tells from its lengths that it samples, and its row still holds its place among them
        rows = set(batch.sample_rows)
        out.committed = [i in rows for i in range(len(out.seqs))]
        for seq, n, sampling in zip(out.seqs, out.num_new_tokens, out.committed, strict=True):
            if seq.is_finished:  # aborted while the step was scheduled: its row's token will be dropped
                continue
            seq.num_computed_tokens += n
            if self.config.enable_prefix_caching:
                self._register(seq)
            if sampling:
                seq.append(PLACEHOLDER)

    def update(
        self, out: SchedulerOutput, sampled: list[int | TokenError], *, committed: bool = False
    ) -> list[Request]:
        """Advance the step's sequences, append the sampled tokens (one per sampling sequence, in order).

        Finishes sequences that stop (:meth:`_stop_reason`), and with ``"error"`` those whose row
        produced a :class:`TokenError` instead of a token. ``committed``: :meth:`commit` advanced them
        already, and each token takes its placeholder's place.

        :return: the sequences that got a token or an error, in step order.
        """
        noted = out.committed if committed else None  # commit() advanced them and noted the sampling rows
        if committed and noted is None:
            raise ValueError("update(committed=True) of a step that commit() did not advance")
        tokens = iter(sampled)
        grown: list[Request] = []
        for i, seq in enumerate(out.seqs):
            if noted is not None:
                sampling = noted[i]
            else:
                sampling = out.samples(i)
                seq.num_computed_tokens += out.num_new_tokens[i]
                if self.config.enable_prefix_caching:
                    self._register(seq)
            if not sampling:
                continue
            token = next(tokens)
            forks, fork_tokens = seq.forks, [next(tokens) for _ in seq.forks]
            if seq.is_finished:  # aborted while the step ran: its token is dropped (its forks ended with it)
                continue
            seq.forks = []
            samples = [(s, t) for s, t in zip(forks, fork_tokens, strict=True) if not s.is_finished]
            for sample, sample_token in samples:  # before seq's token, which may end seq and free its blocks
                if not isinstance(sample_token, TokenError):
                    self._fork(seq, sample)
            for sample, sample_token in [(seq, token), *samples]:
                self._take(sample, sample_token, grown, replace=committed)
        return grown

    def _take(self, seq: Request, token: int | TokenError, grown: list[Request], *, replace: bool = False) -> None:
        """Append ``token`` to ``seq`` (``replace``: in its placeholder's place), or finish it with the row's
        error, and stop it if it ends there."""
        grown.append(seq)
        if isinstance(token, TokenError):
            self.finish(seq, "error", token.message, keep_prefix=not token.cache_suspect)
            return
        if replace:
            seq.token_ids[-1] = token
        else:
            seq.append(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self.finish(seq, reason)

    def _fork(self, parent: Request, sample: Request) -> None:
        """Start ``sample`` where ``parent``'s prompt is computed: its full blocks shared, its partial block copied.

        Without a free block for the copy, or room among ``max_num_seqs``, the sample waits as one
        preempted by recompute.
        """
        full = parent.num_computed_tokens // self.block_size
        partial = parent.block_table[full:]  # the prompt's last, partial block (none when it fills its blocks)
        own = self.pool.allocate(len(partial)) if len(self.running) < self.config.max_num_seqs else None
        if own is None:
            sample.status = RequestStatus.WAITING
            bisect.insort(self.waiting, sample, key=_arrival)
            return
        sample.block_table = self.pool.fork(parent.block_table[:full]) + own
        self._fork_copies += [(sample, src, dst) for src, dst in zip(partial, own, strict=True)]
        sample.num_computed_tokens = parent.num_computed_tokens
        sample.num_cached_tokens = parent.num_cached_tokens
        sample.block_hashes = parent.block_hashes[:full]
        sample.num_registered_blocks = min(parent.num_registered_blocks, full)
        sample.status = RequestStatus.RUNNING
        bisect.insort(self.running, sample, key=_arrival)

    def _stop_reason(self, seq: Request, token: int) -> str | None:
        """Why ``seq`` ends with ``token``, its newest (``None``: it goes on); the one place stopping is decided.

        A stop token or a stop string in the text (``"stop"``) first, then the length (``"length"``:
        ``max_tokens`` or ``max_model_len``): a token that completes a stop string and is also the last
        one allowed ends the request with ``"stop"``, as vLLM reports it, since the text is cut at the
        stop string either way. Before ``min_tokens`` tokens, only ``max_model_len`` ends it. The stop
        matcher is fed every token, also one that ends the request otherwise, so the text it decodes
        stays whole.
        """
        in_text = seq.stop_matcher is not None and seq.stop_matcher.feed(token)
        if seq.num_output_tokens < seq.params.min_tokens:  # only the length ends it before min_tokens
            return "length" if seq.num_tokens >= self.config.max_model_len else None
        if token in seq.stop_token_ids or in_text:
            return "stop"
        if self._ends_by_length(seq):
            return "length"
        return None

    def _ends_by_length(self, seq: Request) -> bool:
        """Whether ``seq``'s newest token is its last, whatever token it is: ``max_tokens`` generated (never fewer
        than ``min_tokens``) or ``max_model_len`` reached."""
        return seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len

    # --- blocks ------------------------------------------------------------------------------------

    def _grow(self, seq: Request, num_tokens: int, unserved: list[Request], out: SchedulerOutput) -> bool:
        """Give running ``seq`` blocks for ``num_tokens``; ``False`` when it was preempted or must wait.

        :param unserved: ``seq`` and the running requests after it, whom it may push out.
        """
        need = seq.blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        blocks = self._allocate(seq, need, unserved, out)
        if blocks is None:
            return False
        seq.block_table += blocks
        return True

    def _allocate(self, seq: Request, need: int, candidates: list[Request], out: SchedulerOutput) -> list[int] | None:
        """``need`` blocks for ``seq``, asking the reclaimer when fewer are plainly free; ``None`` if none now.

        ``candidates`` (running requests) are offered only when cached blocks cannot cover the need.
        """
        pool = self.pool
        if need > pool.num_free - pool.num_cached:
            offered = [s for s in candidates if s.status is RequestStatus.RUNNING] if need > pool.num_free else []
            pressure = MemoryPressure(
                need=need,
                free=pool.num_free - pool.num_cached,
                cached=pool.cached_blocks(),
                candidates=tuple(self._facts(s) for s in offered),
                requester=seq.request_id,
                swap_free=self.swap_pool.num_free if self.swap_pool is not None else 0,
            )
            plan = check_plan(pressure, self.reclaimer.plan(pressure), self.reclaimer_name)
            if plan.preempt or plan.evict != pressure.cached[: need - pressure.free]:
                pool.evict(plan.evict)  # else: exactly what allocate() evicts itself, in the pool's order
            by_id = {s.request_id: s for s in offered}
            for p in plan.preempt:
                self._preempt(by_id[p.request_id], p.mode, out)
            if seq in out.preempted:
                return None
            if need > pool.num_free:
                return None
        return pool.allocate(need)  # None: a plugin's pool may hold back more than num_free says

    def _facts(self, seq: Request) -> RequestFacts:
        ref = self.pool.ref_count
        return RequestFacts(
            request_id=seq.request_id,
            arrival=seq.arrival,
            num_blocks=len(seq.block_table),
            num_freed=sum(1 for b in seq.block_table if ref(b) == 1),
            num_computed_tokens=seq.num_computed_tokens,
        )

    def _release(self, seq: Request) -> None:
        """Free ``seq``'s device blocks, tail first (so its prefix outlives its tail in the cache)."""
        if not seq.block_table:
            return
        self.pool.free(seq.block_table[::-1])
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _forget_prefix(self, seq: Request) -> None:
        """Drop the prefix hashes of the blocks only ``seq`` holds, so no later request hits them."""
        for block in seq.block_table:
            if self.pool.ref_count(block) == 1:
                self.pool.copy_on_write(block)  # the only holder: the pool forgets the block's hash
        seq.num_registered_blocks = 0

    def _preempt(self, seq: Request, mode: str, out: SchedulerOutput) -> None:
        if mode == "swap":
            swap_blocks = self.swap_pool.allocate(len(seq.block_table))
            if swap_blocks is None:
                raise MemoryContractError(
                    f"{self.reclaimer_name}: swap space cannot take request {seq.request_id!r}'s "
                    f"{len(seq.block_table)} blocks"
                )
            out.swap_out += zip(seq.block_table, swap_blocks, strict=True)
            seq.swap_table = swap_blocks
            seq.status = RequestStatus.SWAPPED
            self.num_swapped += 1
        else:
            seq.num_computed_tokens = 0
            seq.status = RequestStatus.WAITING
        self._release(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        bisect.insort(self.waiting, seq, key=_arrival)
        out.preempted.append(seq)

    # --- admissions --------------------------------------------------------------------------------

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.status is RequestStatus.SWAPPED:
                n = self._swap_in(seq, budget, out)
            else:
                n = self._start(seq, budget, out)
            if n is None:
                return
            self.waiting.pop(0)
            seq.status = RequestStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n

    def _start(self, seq: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Prefix lookups and blocks for the first chunk of a waiting request; its token count, or ``None``."""
        # prompt logprobs need the logits of every prompt position: such a request recomputes its cached prefix
        cached = self.config.enable_prefix_caching and seq.params.prompt_logprobs is None
        hits = self._lookup(seq) if cached else []
        if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
            seq.num_cached_tokens = len(hits) * self.block_size
        seq.block_table = hits
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        need = seq.blocks_for(seq.num_computed_tokens + n, self.block_size) - len(hits)
        blocks = self._allocate(seq, need, [], out) if need > 0 else []
        if blocks is None:
            self._release(seq)
            seq.num_computed_tokens = 0
            return None
        seq.block_table = hits + blocks
        return n

    def _lookup(self, seq: Request) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks (one new reference each); stops at the first miss.

        The last token is never taken from the cache: its logits are needed to sample.
        """
        hits: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(self._hash(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def _swap_in(self, seq: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Device blocks for a swapped request, with the copies back; its token count, or ``None``."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        count = len(seq.swap_table)
        need = max(seq.blocks_for(seq.num_computed_tokens + n, self.block_size), count)
        blocks = self._allocate(seq, need, [], out)
        if blocks is None:
            return None
        out.swap_in += zip(seq.swap_table, blocks[:count], strict=True)
        self.swap_pool.free(seq.swap_table)
        seq.swap_table = []
        seq.block_table = blocks
        return n

    # --- prefix caching ----------------------------------------------------------------------------

    def _hash(self, seq: Request, index: int) -> int:
        """The chained content hash of ``seq``'s full block ``index`` (computed once, kept on the sequence)."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(
                self.pool.hash_block(hashes[-1] if hashes else None, seq.token_ids[i * size : (i + 1) * size])
            )
        return hashes[index]

    def _register(self, seq: Request) -> None:
        """Register ``seq``'s newly computed full blocks, so later requests can hit them."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_registered_blocks, full):
            self.pool.register(seq.block_table[i], self._hash(seq, i))
        seq.num_registered_blocks = max(full, seq.num_registered_blocks)


def _arrival(seq: Request) -> int:
    return seq.arrival
