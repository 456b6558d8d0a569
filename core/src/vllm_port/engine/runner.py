"""The model runner: the only engine file that touches tensors, and only through the runtime.

It owns the model, the bound kernels (``runtime.bind``), the paged KV cache and the swap space
(``runtime.kv_cache``), and the migrator between them (``runtime.migrator()``). One step:

1. swap blocks out, then in, as the scheduler asked (the migrator's copies, waited for: rare);
2. one host-to-device copy of the step's integer metadata (pinned staging where the platform has a
   pinned host tier, so the copy does not wait for the device);
3. the **step function** (:data:`StepFunction`): the model's forward over the packed tokens and the
   logits of the rows that sample. This is the seam where a compiled step plugs in (``make_step``;
   :func:`flat_step` adapts ``vllm_port.flat``'s models); by default (:func:`default_step`) the
   model's flat graphs with the fusion passes where the platform captures graphs, else
   ``LlamaModel.forward`` with the bound kernels (:func:`eager_step`). After :meth:`ModelRunner.capture_steps`,
   steps of up to the largest captured size in tokens replay that step captured as device graphs per
   size (:class:`~vllm_port.flat.capture.DecodeGraphs`) on platforms with graph capture: one launch
   instead of hundreds, which is what a batch-1 decode step on a GPU is bound by. A decode step is
   one row per sequence; a prefill or mixed step is one row per token, each row a sequence of its
   own in ``paged_attention``: the token's sequence's block table, its context ending at the token
   (the cache holds the step's keys by then). That is causal attention over the cache, what
   ``prefill_attention`` computes, with no argument that varies between replays;
4. the bound ``sample`` op on the device, seeds ``seed + step`` per request (a step whose rows
   are all greedy takes the argmax, lowest id on ties: what the op returns for such rows);
5. reading the sampled ids, with a flag per row saying its logits are finite (computed on the
   device, read in the same transfer): the step's only host synchronisation.

vLLM's sampling features cost a step nothing unless one of its requests asks for them: the bound
``process_logits`` runs before ``sample`` (penalties, ``min_p``, biases and bans, its dense
``[rows, vocab]`` inputs built for that step) only when ``batch.processing`` has a row, and
``top_logprobs`` (of the raw logits) only for the rows in ``batch.logprobs`` and the prompt
positions in ``batch.prompt_logprobs``; their answers come back in a second transfer that only such
steps make (a :class:`~.scheduler.StepResult`). A step with prompt logprobs is never replayed from
a captured graph (its prompt rows' logits come from the eager step).

No answer from non-finite values, and no id outside the vocabulary: a row whose logits hold NaN or
Inf, or whose sampled id is not in ``[0, vocab_size)``, gets a :class:`~.scheduler.TokenError`
in its token's place (the scheduler finishes that request with ``"error"``; the other rows go on).
The message names the step; for non-finite logits in debug mode (``VLLM_PORT_CHECK``) the step is
re-run with every op compared with its reference (:func:`~vllm_port.ops.debug.scrutinize`) to
name the op that produced them; an id outside the vocabulary is blamed on the ``sample`` provider.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import MemoryContractError, ProviderError
from ..flat.capture import DecodeGraphs, padded_batch_sizes
from ..memory import KVLayout
from ..models import AttentionMetadata, LlamaModel, load_model
from ..ops import BoundOps
from ..ops.debug import CheckedOp, blame, provider_fault, scrutinize
from .scheduler import StepBatch, StepResult, TokenError, TopLogprobs

__all__ = [
    "REPLAY_READ_FACTOR",
    "ModelRunner",
    "PendingStep",
    "StepFeed",
    "StepFunction",
    "default_step",
    "eager_step",
    "flat_step",
]

#: A replayed prefill or mixed step's rows may read this many times the model's bytes in keys and values. One
#: row per token reads each token's context anew, where the prefill kernel reads a tile of keys once for many
#: queries; rows of one sequence run side by side, so most of those reads should hit the L2 cache. The factor is
#: an estimate, not a measurement: a chunk of 512 tokens ending at 1,024 (Llama-3-8B's rows read 3.2x its
#: weights) still replays, one ending at 4,096 (16x) runs eagerly. ``dev/experiments/probe_token_rows.py``
#: times both ways on a GPU.
REPLAY_READ_FACTOR = 4

#: ``step(input_ids, positions, kv_caches, meta, logits_rows) -> logits [len(logits_rows), vocab]``:
#: one forward over the packed tokens of a step, with the logits of the rows in ``logits_rows``. A step that
#: holds memory of its own (a flat model's graphs) carries a ``close()`` that :meth:`ModelRunner.close` calls.
StepFunction = Callable[
    [torch.Tensor, torch.Tensor, Sequence[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata, torch.Tensor],
    torch.Tensor,
]

#: Swap-tier names a platform may declare, in order of preference (pinned memory copies asynchronously).
SWAP_TIERS = ("pinned_host", "host")


def eager_step(model: LlamaModel, ops: BoundOps) -> StepFunction:
    """The model's own forward with the bound kernels, op by op (every platform can run it)."""

    def step(input_ids, positions, kv_caches, meta, logits_rows):
        hidden = model.forward(ops, input_ids, positions, kv_caches, meta)
        return model.compute_logits(ops, hidden.index_select(0, logits_rows))

    return step


def flat_step(flat_model: Any) -> StepFunction:
    """The step of an object with ``forward(input_ids, positions, kv_caches, meta)`` and ``compute_logits(hidden)``.

    ``vllm_port.flat.FlatModel`` has that shape (flat graphs, eager or compiled)::

        LLM(model_dir, make_step=lambda runner: flat_step(FlatModel(runner.model, runner.runtime, block_size=runner.block_size)))
    """

    def step(input_ids, positions, kv_caches, meta, logits_rows):
        hidden = flat_model.forward(input_ids, positions, kv_caches, meta)
        return flat_model.compute_logits(hidden.index_select(0, logits_rows))

    if hasattr(flat_model, "close"):
        step.close = flat_model.close  # type: ignore[attr-defined]
    return step


def default_step(runner: ModelRunner, own_ops: bool = True) -> StepFunction:
    """The step a runner takes when it is given none.

    Where the platform captures graphs, the model's flat graphs with the fusion passes run eagerly
    (``vllm_port.flat.FlatModel(compile=False)``): fused kernels, and the graph interpreter's host
    cost disappears into the captured decode steps. Elsewhere the model's own forward
    (:func:`eager_step`), which on CPU is faster than interpreting the flat graph. Ranks of tensor
    parallelism (``own_ops=False``: their ``linear`` sums over ranks) run the model's forward too.
    """
    if own_ops and runner.runtime.platform.graph_capture:
        from ..flat import FlatModel

        flat = FlatModel(runner.model, runner.runtime, runner.model.dtype, compile=False, block_size=runner.block_size)
        return flat_step(flat)  # traced for the dtype of the caches it first runs on
    return eager_step(runner.model, runner.ops)


class ModelRunner:
    """A model with its KV cache on the runtime's platform; :meth:`execute` runs one scheduled step.

    :param runtime: the selected platform.
    :param model: the loaded model (on ``runtime``'s device), or a model directory to load.
    :param kv_cache_memory: the KV cache's budget: a fraction in (0, 1] of the free device memory
        after the weights, or bytes; at most ``max_tokens`` tokens' worth is taken when given.
    :param swap_space: bytes of swap space in the platform's host tier (0: none; preemption then recomputes).
    :param max_tokens: tokens the cache never needs to exceed (caps the budget), or ``None``.
    :param make_step: builds the step function from the runner (its ``model``, ``ops``, ``kv_caches``,
        ``runtime``) once the cache exists; default :func:`default_step`. See the module docstring.
    :param ops: bound kernels to use instead of ``runtime.bind(model.dtype)`` (tensor parallelism wraps them).
    :param device: where the model lives (default ``runtime.device``; a tensor-parallel rank's own device).
    :param placement: a :class:`~vllm_port.placement.EnginePlacement`: the model's nodes on several
        platforms (``runtime`` is the first), each layer's KV cache on its attention's platform, and
        its step (unless ``make_step`` is given).
    :param max_positions: positions the rotary table of a model loaded from a directory covers
        (default: the config's ``max_position_embeddings``); the engine passes its ``max_model_len``.
    :param kv_cache_dtype: ``"auto"``: the cache in the model's dtype; ``"fp8"``/``"fp8_e4m3"``: in float8 e4m3
        (the pool's blocks sized by it), which the model reads and writes through the ``*_fp8`` cache ops.
    """

    def __init__(
        self,
        runtime: Any,
        model: LlamaModel | str | os.PathLike[str],
        dtype: torch.dtype | None = None,
        *,
        block_size: int = 16,
        kv_cache_memory: float | int = 0.8,
        swap_space: int = 0,
        max_tokens: int | None = None,
        make_step: Callable[[ModelRunner], StepFunction] | None = None,
        ops: BoundOps | None = None,
        device: torch.device | None = None,
        placement: Any = None,
        max_positions: int | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.runtime = runtime
        self.device = device or runtime.device
        # "fp8": the cache in e4m3 (half of bfloat16's bytes a block: the pool holds twice the blocks), read and
        # written by the *_fp8 cache ops (the model sees the cache's dtype); "auto": the model's dtype
        fp8_cache = None if kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if placement is not None:  # loaded into host memory, each node's weights moved to its platform
            model = placement.prepare(model, dtype or torch.float32, block_size, max_positions, fp8_cache)
        elif isinstance(model, (str, os.PathLike)):  # else a loaded model: LlamaModel, or one of its shape (importer)
            model = load_model(model, self.device, dtype or torch.float32, max_positions=max_positions)
        self.model = model
        self.config = model.config
        self.ops = ops or runtime.bind(model.dtype)
        #: the ops were bound here (a tensor-parallel rank's ops sum over ranks, a pipeline stage's step receives
        #: from the stage before: a re-run on one rank would hang)
        self._own_ops = ops is None
        #: steps executed so far (error messages name the step)
        self.num_steps = 0
        #: steps launched so far (a launched step's captured logits are current until the next launch)
        self.num_launches = 0
        self.block_size = block_size
        c = model.config
        cache_dtype = model.dtype if fp8_cache is None else fp8_cache
        self.layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_size, block_size, cache_dtype)
        budget = _budget(runtime, kv_cache_memory, self.layout, max_tokens)
        if placement is not None:
            self.kv = placement.kv_cache(self.layout, budget, swap_space)
        else:
            self.kv = runtime.kv_cache(self.layout, budget)
        self.kv_caches = list(zip(self.kv.key_caches, self.kv.value_caches, strict=True))
        try:
            self.swap = self._swap_cache(swap_space)
        except BaseException:
            self.kv.close()
            raise
        if make_step is None and placement is not None:
            make_step = placement.make_step
        self.step = make_step(self) if make_step is not None else default_step(self, own_ops=ops is None)
        #: stage host metadata in page-locked memory, so its copy to the device does not wait for it
        self._pinned = "pinned_host" in runtime.platform.memory_tiers
        #: steps captured per size in rows (:meth:`capture_steps`), or ``None``: every step eager
        self.decode_graphs: DecodeGraphs | None = None
        #: whether prefill and mixed steps replay the captured graphs too (decode steps always do); a benchmark
        #: turns it off to measure what replaying them gains
        self.replay_prefill = True
        #: the most context a replayed prefill or mixed step may read, in tokens summed over its tokens (set by
        #: :meth:`capture_steps` from :data:`REPLAY_READ_FACTOR`); a step past it (a long prompt's chunk) runs eagerly
        self.max_replayed_context = 0
        #: the most tokens a replayed prefill or mixed step may hold (set by :meth:`capture_steps`)
        self.max_replayed_tokens = 0
        #: steps run so far by how: ``"decode replayed"``, ``"prefill replayed"`` (prefill or mixed), ``"eager"``
        self.steps_by_kind: Counter[str] = Counter()

    def _swap_cache(self, swap_space: int) -> Any:
        if not swap_space:
            return None
        tiers = [t for t in SWAP_TIERS if t in self.runtime.platform.memory_tiers]
        if not tiers:
            raise MemoryContractError(
                f"swap_space={swap_space:,} bytes, but platform {self.runtime.platform.name!r} has no host tier to "
                f"swap to (memory_tiers: {', '.join(self.runtime.platform.memory_tiers)}); set swap_space=0"
            )
        return self.runtime.kv_cache(self.layout, swap_space, tier=tiers[0])

    @property
    def pool(self) -> Any:
        """The device KV cache's block pool (the scheduler allocates from it and asks it what is cached)."""
        return self.kv.pool

    @property
    def provider_per_op(self) -> dict[str, str]:
        """The provider bound to each op."""
        return {op: p.name for op, p in sorted(self.ops.providers.items())}

    @property
    def swap_pool(self) -> Any:
        """The swap space's block pool, or ``None``."""
        return None if self.swap is None else self.swap.pool

    def close(self) -> None:
        """Give the caches' memory back to their allocators now, and drop the captured graphs.

        The graphs' replays call this runner's step, so runner and graphs hold each other: dropped here, the
        weights and the graphs' memory pools go with the last reference to the runner, without waiting for
        the garbage collector (an engine built next in the process would otherwise load beside them).
        """
        self.kv.close()
        self.kv_caches = []  # the per-layer views: while one lives, so does the whole buffer
        if self.swap is not None:
            self.swap.close()
        self.decode_graphs = None
        close_step = getattr(self.step, "close", None)
        if close_step is not None:  # a flat model's graphs hold the weights in fx's reference cycles
            close_step()

    def capture_steps(self, max_rows: int, max_model_len: int, max_prefill_tokens: int | None = None) -> list[int]:
        """Capture the step for up to ``max_rows`` rows over contexts up to ``max_model_len``.

        A row is a sequence in a decode step and a token in a prefill or mixed one, so decode steps of up
        to ``max_rows`` sequences and other steps of up to ``max_prefill_tokens`` tokens (default and at
        most ``max_rows``) replay the graphs. Returns
        the captured sizes: empty where the platform has no graph capture (every step then stays as it
        is). Capturing runs the step a few times on padding rows, which write nothing to the cache and
        read nothing from it.
        """
        capture = self.runtime.graph_capture()
        if capture is None:
            return []
        sizes = padded_batch_sizes(max_rows)
        self.max_replayed_tokens = min(max_rows, max_rows if max_prefill_tokens is None else max_prefill_tokens)
        token_bytes = sum(c[0, 0].numel() * c.element_size() for layer in self.kv_caches for c in layer)
        self.max_replayed_context = REPLAY_READ_FACTOR * _tensor_bytes(self.model) // max(token_bytes, 1)
        with torch.inference_mode():
            self.decode_graphs = DecodeGraphs(
                self._decode_step(sizes[-1]), capture, sizes, -(-max_model_len // self.block_size), self.device
            )
        return sizes

    def _decode_step(self, largest: int) -> Any:
        """The step function as a decode step: every row one sequence of one token, every row's logits."""
        cu_seqlens = torch.arange(largest + 1, dtype=torch.int32, device=self.device)
        rows = torch.arange(largest, dtype=torch.int64, device=self.device)

        def step(input_ids, positions, slot_mapping, block_tables, seq_lens):
            n = input_ids.shape[0]
            meta = AttentionMetadata(slot_mapping, block_tables, seq_lens, cu_seqlens[: n + 1], 1, is_decode=True)
            return self.step(input_ids, positions, self.kv_caches, meta, rows[:n])

        return step

    def _captured(self, batch: StepBatch) -> bool:
        graphs = self.decode_graphs
        if graphs is None or batch.prompt_logprobs or not (batch.is_decode or self.replay_prefill):
            return False
        if batch.is_decode:
            return len(batch.query_lens) <= graphs.batch_sizes[-1]
        # the prefill rows' contexts: n > 1 new tokens over seq_len cached ones read seq_len - n + 1 .. seq_len
        # (a decode row reads its context once either way)
        lens = zip(batch.query_lens, batch.seq_lens, strict=True)
        context = sum(n * seq_len - n * (n - 1) // 2 for n, seq_len in lens if n > 1)
        return len(batch.input_ids) <= self.max_replayed_tokens and context <= self.max_replayed_context

    def _replay(
        self, batch: StepBatch, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: torch.Tensor
    ) -> tuple[torch.Tensor, bool]:
        """The step's sampling rows' logits from the captured graphs, and whether they are the graph's output buffer.

        A decode step replays its sequences as rows. Any other step replays one row per token: row ``t``
        of sequence ``s`` attends through ``s``'s block table to the ``seq_lens[s] - (tokens of s after t)``
        cached tokens ending at ``t``; the cache write before attention put the step's keys there.
        """
        graphs = self.decode_graphs
        if batch.is_decode:
            logits = graphs(ids, positions, meta.slot_mapping, meta.block_tables, meta.seq_lens)
            if batch.sample_rows == list(range(len(batch.query_lens))):  # rows are every sequence, in order
                return logits, True
            return logits[rows], False
        ends = meta.cu_seqlens_q[1:]
        tokens = torch.arange(len(batch.input_ids), dtype=ends.dtype, device=ends.device)
        seq = torch.searchsorted(ends, tokens, right=True)  # each token's sequence
        seq_lens = meta.seq_lens[seq] - (ends[seq] - 1 - tokens)
        logits = graphs(ids, positions, meta.slot_mapping, meta.block_tables[seq], seq_lens)
        return logits[rows], False

    # --- one step ----------------------------------------------------------------------------------

    def execute(self, batch: StepBatch) -> list[int | TokenError]:
        """Run one step; return the token sampled for each of ``batch.sample_rows``, in order.

        A row whose logits are not finite, or whose sampled id is outside the vocabulary, gets a
        :class:`TokenError` saying why instead of a token. When the batch asks for logprobs (of the
        drawn tokens or of prompt tokens) the list is a :class:`StepResult` carrying them.
        """
        return self.launch(batch).result()

    def forward(self, batch: StepBatch) -> None:
        """Run the step's forward and sample nothing: a pipeline stage before the last, whose step function
        sends its residual stream on to the next stage (``vllm_port.engine.pipeline_parallel``)."""
        self._migrate(batch)
        if not batch.query_lens:
            return
        self.num_steps += 1
        with torch.inference_mode(), blame(self.ops):
            ids, positions, meta, rows, *_ = self._tensors(batch)
            self.step(ids, positions, self.kv_caches, meta, rows)

    def launch(self, batch: StepBatch, feed: StepFeed | None = None) -> PendingStep:
        """Start one step on the device and return without waiting for it (:meth:`execute` = ``launch(...).result()``).

        The sampled ids stay on the device until :meth:`PendingStep.result` reads them, so the host can
        schedule and launch the next step meanwhile (``LLM(async_scheduling=True)``). ``feed`` fills that
        next step's input ids that the host does not know yet (the tokens this step samples) from the
        device, before the forward.
        """
        self._migrate(batch)
        if not batch.query_lens:
            return PendingStep.ready([])
        self.num_steps += 1
        self.num_launches += 1
        with torch.inference_mode(), blame(self.ops):  # a provider that raises is named (no cost otherwise)
            ids, positions, meta, rows, top_k, seeds, temperature, top_p = self._tensors(batch)
            if feed is not None:
                feed.fill(ids, self._upload)
            prompt_rows = self._prompt_rows(batch) if batch.prompt_logprobs else None
            captured = self._captured(batch)
            kind = "decode replayed" if batch.is_decode else "prefill replayed"
            self.steps_by_kind[kind if captured else "eager"] += 1
            prompt_logits = None
            if captured:
                logits, captured = self._replay(batch, ids, positions, meta, rows)
            elif prompt_rows is not None:  # the prompt positions whose logprobs are asked for, after the sampling rows
                both = self.step(ids, positions, self.kv_caches, meta, torch.cat((rows, prompt_rows[0])))
                logits, prompt_logits = both[: len(rows)], both[len(rows) :]
            else:
                logits = self.step(ids, positions, self.kv_caches, meta, rows)
            if not batch.sample_rows:
                return PendingStep.ready(
                    [] if prompt_rows is None else self._with_prompt_logprobs(batch, [], prompt_rows, prompt_logits)
                )
            # a flag per row, on the device: NaN and Inf make the row's float32 sum non-finite (so would
            # finite logits past 1e34, which _non_finite_row tells apart); one read of the logits
            if any(batch.temperatures) or batch.processing:
                finite = logits.sum(dim=-1, dtype=torch.float32).isfinite()
                # the sample op's contract refuses NaN logits: such rows draw from zeros (their id is dropped)
                usable = logits.masked_fill(~finite[:, None], 0.0)
                # penalties, min_p, biases and bans: only in a step where some request has them
                processed = self._processed(batch, usable, temperature) if batch.processing else usable
                if any(batch.temperatures):
                    # None where no sampled row truncates (SamplingParams' defaults): the provider skips its sort
                    by_k, by_p = _truncates(batch, logits.shape[-1])
                    sampled = self.ops.sample(
                        processed, temperature, top_k if by_k else None, top_p if by_p else None, seeds
                    )
                else:  # every row greedy: the argmax of the processed logits (lowest id on ties)
                    sampled = _argmax_rows(processed)
                sampled = self._checked_ids(sampled, len(rows))
            else:  # every row greedy: the sample op's answer by contract, without its sort and noise
                # widened first: exact, so the same ids and ties, and argmax over float32 is several
                # times faster than over bfloat16/float16 on CPU (a few ms a step over 32000 columns)
                wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
                finite = wide.sum(dim=-1).isfinite()
                sampled = _argmax_rows(wide)
            pending = PendingStep(
                self, batch, sampled, finite, logits, captured, lambda: self.step(ids, positions, self.kv_caches, meta, rows),
                prompt_rows, prompt_logits,
            )  # fmt: skip
            pending.ids_and_flags = torch.stack((sampled, finite.to(sampled.dtype)))
            if self._pinned:  # the copy to the host queued now, behind this step and ahead of any launched after it
                host = torch.empty(pending.ids_and_flags.shape, dtype=sampled.dtype, pin_memory=True)
                host.copy_(pending.ids_and_flags, non_blocking=True)
                pending.ids_and_flags, pending.copied = host, torch.Event(device=sampled.device)
                pending.copied.record()
            return pending

    def _result(self, pending: PendingStep) -> list[int | TokenError]:
        """The tokens of a launched step: its one host synchronisation, then the rare paths (errors, logprobs)."""
        batch, sampled, logits = pending.batch, pending.sampled, pending.logits
        with torch.inference_mode(), blame(self.ops):
            if pending.copied is not None:  # the step's one host sync waits for its own copy only
                pending.copied.synchronize()
            tokens, flags = pending.ids_and_flags.tolist()  # (else the one host sync is here)
            vocab = logits.shape[-1]
            if all(flags) and min(tokens) >= 0 and max(tokens) < vocab:
                result: list[int | TokenError] = tokens
            else:
                if pending.captured and pending.launch != self.num_launches:
                    # a later step replayed the same graph over its output: the step's logits again (its keys and
                    # values are in the cache, rewritten with the same values), for the diagnosis
                    logits = pending.rerun()
                result = self._row_errors(batch, logits, tokens, flags, pending.rerun)
            if batch.logprobs:  # a second transfer, only when some request asks for logprobs
                result = self._with_logprobs(batch, result, logits, sampled)
            if pending.prompt_rows is not None:
                result = self._with_prompt_logprobs(batch, result, pending.prompt_rows, pending.prompt_logits)
            return result

    # --- logits processors and logprobs (only for steps whose requests ask for them) ---------------

    def _processed(self, batch: StepBatch, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        """The bound ``process_logits`` over every sampling row; rows without processors get its identity.

        Its dense inputs are built on the device from one int64 and one float32 upload (as the step's
        metadata: pinned staging, no wait): per row the four parameters, and ``(row, token)`` pairs of
        the allowed, biased, banned, prompt and generated tokens.
        """
        rows, vocab = logits.shape
        per_row = [[1.0] * rows, [0.0] * rows, [0.0] * rows, [0.0] * rows]
        limited: list[int] = []  # rows with allowed_token_ids
        pairs: dict[str, list[int]] = {kind: [] for kind in ("allowed", "biased", "banned", "seen", "generated")}
        bias_values: list[float] = []
        for row, p in batch.processing.items():
            values = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty, p.min_p)
            for column, value in zip(per_row, values, strict=True):
                column[row] = value
            if p.allowed_token_ids is not None:
                limited.append(row)
                pairs["allowed"] += [x for t in p.allowed_token_ids for x in (row, t)]
            pairs["biased"] += [x for t in p.logit_bias for x in (row, t)]
            bias_values += p.logit_bias.values()
            pairs["banned"] += [x for t in p.banned_token_ids if t < vocab for x in (row, t)]
            pairs["seen"] += [x for t in p.prompt_token_ids for x in (row, t)]
            pairs["generated"] += [x for t in p.output_token_ids if 0 <= t < vocab for x in (row, t)]
        ints = self._upload([*limited, *(x for kind in pairs.values() for x in kind)], torch.int64)
        limited_rows, *flat = ints.split([len(limited), *(len(kind) for kind in pairs.values())])
        at = {kind: tuple(t.view(-1, 2).t()) for kind, t in zip(pairs, flat, strict=True)}
        floats = self._upload([*(x for column in per_row for x in column), *bias_values], torch.float32)
        repetition, frequency, presence, min_p, biases = floats.split([rows] * 4 + [len(bias_values)])
        device = logits.device
        bias = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        bias[limited_rows] = float("-inf")  # everything but the allowed tokens banned in those rows
        bias[at["allowed"]] = 0.0
        bias.index_put_(at["biased"], biases, accumulate=True)
        bias[at["banned"]] = float("-inf")
        prompt = torch.zeros(rows, vocab, dtype=torch.bool, device=device)
        prompt[at["seen"]] = True
        counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
        generated = at["generated"]
        counts.index_put_(generated, torch.ones_like(generated[0], dtype=torch.int32), accumulate=True)
        return self.ops.process_logits(
            logits, bias, counts, prompt, repetition, frequency, presence, temperature, min_p
        )

    def _with_logprobs(
        self, batch: StepBatch, result: list[Any], logits: torch.Tensor, sampled: torch.Tensor
    ) -> StepResult:
        """``result`` with the drawn tokens' logprobs (of the raw logits) for the rows that ask for them."""
        asking = sorted(batch.logprobs)
        at = self._upload(asking, torch.int64)
        vocab = logits.shape[-1]
        raw = logits.index_select(0, at)
        raw = raw.masked_fill(~raw.isfinite().all(dim=-1, keepdim=True), 0.0)  # such a row is an error anyway
        ids = sampled.index_select(0, at).clamp(0, vocab - 1)
        values, indices = self.ops.top_logprobs(raw, ids, max(batch.logprobs[r] for r in asking))
        found = _top_logprobs(values.tolist(), indices.tolist(), ids.tolist(), [batch.logprobs[r] for r in asking])
        return StepResult(result, dict(zip(asking, found, strict=True)), getattr(result, "prompt_logprobs", None))

    def _prompt_rows(self, batch: StepBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The packed rows of the prompt positions whose logprobs are asked for, and ``(sequence, index of the prompt
        token, that token)`` for each: a position's logits predict the next prompt token."""
        starts, total = [], 0
        for n in batch.query_lens:
            starts.append(total)
            total += n
        rows, where = [], []
        for seq, (_, targets) in sorted(batch.prompt_logprobs.items()):
            first = batch.seq_lens[seq] - batch.query_lens[seq]  # the chunk's first position
            for offset, token in enumerate(targets):
                rows.append(starts[seq] + offset)
                where.append((seq, first + offset + 1, token))
        return self._upload(rows, torch.int64), where

    def _with_prompt_logprobs(
        self, batch: StepBatch, result: list[Any], prompt_rows: Any, logits: torch.Tensor
    ) -> StepResult:
        """``result`` with the logprobs of the prompt tokens this step's logits predict."""
        _, where = prompt_rows
        out = StepResult(result, getattr(result, "logprobs", None))
        if not where:
            return out
        raw = logits.masked_fill(~logits.isfinite().all(dim=-1, keepdim=True), 0.0)
        ids = [token for *_, token in where]
        wanted = [batch.prompt_logprobs[seq][0] for seq, *_ in where]
        values, indices = self.ops.top_logprobs(raw, self._upload(ids, torch.int64), max(wanted))
        for (seq, index, _), found in zip(
            where, _top_logprobs(values.tolist(), indices.tolist(), ids, wanted), strict=True
        ):
            out.prompt_logprobs.setdefault(seq, []).append((index, found))
        return out

    def _checked_ids(self, sampled: Any, rows: int) -> torch.Tensor:
        """The sample op's answer, refused unless it is one integer id per row (metadata only: no sync)."""
        if (
            isinstance(sampled, torch.Tensor)
            and sampled.shape == (rows,)
            and not sampled.is_floating_point()
            and not sampled.is_complex()
        ):
            return sampled
        got = (
            f"shape {tuple(sampled.shape)}, dtype {sampled.dtype}"
            if isinstance(sampled, torch.Tensor)
            else type(sampled).__name__
        )
        chosen = self.ops.providers["sample"]
        raise ProviderError(
            provider_fault(self.ops, "sample", f"returned {got}; the op returns int64 ids of shape [{rows}]"),
            "sample",
            chosen.name,
            chosen.plugin,
        )

    def _row_errors(
        self, batch: StepBatch, logits: torch.Tensor, tokens: list[int], flags: list[int], rerun: Callable[[], Any]
    ) -> list[int | TokenError]:
        """The step's tokens with a :class:`TokenError` for each row whose logits or id are bad (the rare path)."""
        vocab, sampler = logits.shape[-1], any(batch.temperatures)
        cause: list[str] = []  # the step's diagnosis, made once, at the first non-finite row
        out: list[int | TokenError] = []
        for row, (token, finite) in enumerate(zip(tokens, flags, strict=True)):
            where = f"engine step {self.num_steps}, this request's token at position {batch.seq_lens[batch.sample_rows[row]]}"
            if not finite:
                if not cause:
                    cause.append(self._non_finite_cause(rerun))
                out.append(TokenError(f"{where}: {_non_finite_row(logits[row])}; {cause[0]}", cache_suspect=True))
            elif not 0 <= token < vocab:
                out.append(TokenError(f"{where}: {self._bad_id(token, vocab, sampler)}"))
            else:
                out.append(token)
        return out

    def _non_finite_cause(self, rerun: Callable[[], Any]) -> str:
        """Which op produced the non-finite logits: debug mode re-runs the step to find it; else how to find it."""
        checked = any(isinstance(getattr(self.ops, op), CheckedOp) for op in self.ops.providers)
        if checked and self._own_ops:
            return scrutinize(rerun).verdict()
        if checked:
            return (
                "run in one process (tensor_parallel_size=1, pipeline_parallel_size=1) with VLLM_PORT_CHECK=1 to find "
                "the op that produced them"
            )
        return (
            "the op that produced them is not known: run with VLLM_PORT_CHECK=1 (debug mode), which re-runs such a step "
            "comparing every op with its reference and names the first one at fault"
        )

    def _bad_id(self, token: int, vocab: int, sampler: bool) -> str:
        """The message for a sampled id outside ``[0, vocab)``: the ``sample`` provider's fault (or the engine's)."""
        problem = f"returned token id {token} for this request, outside the vocabulary [0, {vocab})"
        if not sampler:
            return f"the engine's greedy argmax {problem}; please report this"
        return provider_fault(self.ops, "sample", problem)

    def _migrate(self, batch: StepBatch) -> None:
        # Swaps happen under memory pressure only; waiting for them keeps the step's reads and the
        # blocks' reuse ordered after the copies on every platform. Forked samples' partial blocks
        # are copied first: their sources may be swapped out or reused by a swap-in next.
        if batch.copies:
            self._copy_blocks(batch.copies)
        if batch.swap_out:
            self.runtime.migrator().copy_blocks(self.kv.blocks, self.swap.blocks, batch.swap_out).wait()
        if batch.swap_in:
            self.runtime.migrator().copy_blocks(self.swap.blocks, self.kv.blocks, batch.swap_in).wait()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks within the KV cache: through the migrator where one tensor holds every
        layer's blocks, else layer by layer (a placed model's layers live on several platforms)."""
        if self.kv.blocks is not None:
            self.runtime.migrator().copy_blocks(self.kv.blocks, self.kv.blocks, pairs).wait()
            return
        with torch.inference_mode():
            for key_cache, value_cache in self.kv_caches:
                for cache in (key_cache, value_cache):
                    if cache.element_size() == 1:  # an FP8 cache: copied as bytes (no float8 index_copy_)
                        cache = cache.view(torch.uint8)
                    src, dst = (torch.tensor(ids, device=cache.device) for ids in zip(*pairs, strict=True))
                    cache.index_copy_(0, dst, cache.index_select(0, src))

    def _tensors(self, b: StepBatch) -> tuple[Any, ...]:
        """The step's tensors on the device, from one int64 and one float32 host buffer."""
        num_tokens, num_seqs, num_samples = len(b.input_ids), len(b.query_lens), len(b.sample_rows)
        _check_positions(b.positions, getattr(self.model, "max_positions", None))
        width = max(len(t) for t in b.block_tables) or 1
        tables = [x for t in b.block_tables for x in (*t, *[0] * (width - len(t)))]
        cu_seqlens, rows, total = [0], [], 0
        for n in b.query_lens:
            total += n
            cu_seqlens.append(total)
        rows = [cu_seqlens[i + 1] - 1 for i in b.sample_rows]
        ints = self._upload(
            [
                *b.input_ids,
                *b.positions,
                *b.slot_mapping,
                *tables,
                *b.seq_lens,
                *cu_seqlens,
                *rows,
                *b.top_ks,
                *b.seeds,
            ],
            torch.int64,
        )
        floats = self._upload([*b.temperatures, *b.top_ps], torch.float32)
        sizes = [num_tokens, num_tokens, num_tokens, num_seqs * width, num_seqs, num_seqs + 1, num_samples]
        ids, positions, slots, flat_tables, seq_lens, cu, logits_rows, top_k, seeds = ints.split(
            [*sizes, num_samples, num_samples]
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=flat_tables.view(num_seqs, width).to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            cu_seqlens_q=cu.to(torch.int32),
            max_query_len=max(b.query_lens),
            is_decode=b.is_decode,
            num_decodes=0 if b.is_decode else _leading_decode_rows(b.query_lens),
        )
        temperature, top_p = floats.split([num_samples, num_samples])
        return ids, positions, meta, logits_rows, top_k, seeds, temperature, top_p

    def _upload(self, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(values, dtype=dtype)
        if self._pinned:
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)


def _tensor_bytes(model: Any) -> int:
    """Bytes of the tensors a model holds: its own, its layers' and its modules' (each tensor once)."""
    seen: dict[int, int] = {}
    visited: set[int] = set()

    def add(value: Any) -> None:
        if id(value) in visited:
            return
        visited.add(id(value))
        if isinstance(value, torch.Tensor):
            seen[value.data_ptr()] = value.numel() * value.element_size()
        elif isinstance(value, torch.nn.Module):
            for t in (*value.parameters(), *value.buffers()):
                add(t)
        elif isinstance(value, (list, tuple)):
            for v in value:
                add(v)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            for v in vars(value).values():
                if isinstance(v, (torch.Tensor, torch.nn.Module, list, tuple)):
                    add(v)

    for value in vars(model).values() if hasattr(model, "__dict__") else ():
        add(value)
    return sum(seen.values())


def _top_logprobs(
    values: list[list[float]], indices: list[list[int]], token_ids: list[int], wanted: list[int]
) -> list[TopLogprobs]:
    """The ``top_logprobs`` op's rows (read on the host) as :class:`TopLogprobs`, each cut to the number its request wants."""
    return [
        TopLogprobs(token, v[0], i[0], tuple(zip(i[1 : 1 + n], v[1 : 1 + n], strict=True)))
        for v, i, token, n in zip(values, indices, token_ids, wanted, strict=True)
    ]


#: Columns per chunk of :func:`_argmax_rows`'s first pass.
_ARGMAX_CHUNK = 128


def _leading_decode_rows(query_lens: list[int]) -> int:
    """How many sequences at the front of a step have one query token (``AttentionMetadata.num_decodes``)."""
    for i, n in enumerate(query_lens):
        if n != 1:
            return i
    return len(query_lens)


def _truncates(batch: StepBatch, vocab: int) -> tuple[bool, bool]:
    """Whether some sampled row of ``batch`` truncates by top-k (``0 < k < vocab``), and by top-p (``p < 1``)."""
    sampled = [i for i, t in enumerate(batch.temperatures) if t > 0]
    return (
        any(0 < batch.top_ks[i] < vocab for i in sampled),
        any(batch.top_ps[i] < 1 for i in sampled),
    )


def _argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same ids (the first maximum; the first NaN where there is one).

    On CPU in two passes: torch's CPU argmax walks each row with its index in scalar code (1-2 ms a decode step
    over 64 x 32,000 float32 logits on a 2-core EPYC), where the maxima of 128-column chunks are one vectorised
    ``amax``. The first chunk holding a row's maximum holds its first maximum; its own argmax gives the column.
    Columns past the last whole chunk are compared after, a later column winning only when strictly larger (or
    NaN where the rest has none). On other devices ``argmax`` is one kernel already.
    """
    rows, cols = x.shape
    if x.device.type != "cpu" or cols < 2 * _ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    body = cols - cols % _ARGMAX_CHUNK
    chunks = x[:, :body].reshape(rows, body // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    every_row = torch.arange(rows, device=x.device)
    chunk = chunks.amax(dim=-1).argmax(dim=-1)
    ids = chunk * _ARGMAX_CHUNK + chunks[every_row, chunk].argmax(dim=-1)
    if body < cols:
        tail_max, tail_id = x[:, body:].max(dim=-1)
        best = x[every_row, ids]
        later = (tail_max > best) | (tail_max.isnan() & ~best.isnan())
        ids = torch.where(later, tail_id + body, ids)
    return ids


def _non_finite_row(row: torch.Tensor) -> str:
    """What is wrong with one row of logits whose float32 sum is not finite (read on the host: the rare path)."""
    nan, inf = int(row.isnan().sum()), int(row.isinf().sum())
    if nan or inf:
        return f"its {row.numel():,} logits hold {nan:,} NaN and {inf:,} infinite value(s): no token can be drawn from them"
    return (
        f"its logits are finite but so large (largest magnitude {float(row.abs().max()):.3g}) that they sum past "
        "float32's range: the model's activations blew up"
    )


def _check_positions(positions: Sequence[int], table_rows: int | None) -> None:
    """Refuse a step with a position past the model's rotary table (a kernel would read outside it)."""
    if table_rows is not None and positions and max(positions) >= table_rows:
        raise ValueError(
            f"a step places a token at position {max(positions)}, but the model's rotary table covers positions "
            f"[0, {table_rows}) (its max_positions, the engine's max_model_len); a context must stay below it"
        )


def _budget(runtime: Any, kv_cache_memory: float | int, layout: KVLayout, max_tokens: int | None) -> float | int:
    """The KV budget: as given, but no more bytes than ``max_tokens`` tokens need (in whole blocks)."""
    if max_tokens is None or isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        return kv_cache_memory  # KVCache refuses what is not a budget, naming it
    cap = -(-max_tokens // layout.block_size) * layout.block_bytes
    if isinstance(kv_cache_memory, float):
        if not 0.0 < kv_cache_memory <= 1.0:
            return kv_cache_memory
        free, _ = runtime.allocator().mem_info()
        return min(int(free * kv_cache_memory), cap)
    return min(kv_cache_memory, cap)


class StepFeed:
    """The next step's input ids that are this step's samples: filled on the device, never read by the host.

    :param sampled: the launched step's sampled ids ``[rows]`` (on the device).
    :param positions: indices into the next step's ``input_ids`` that hold a placeholder.
    :param rows: for each such index, the row of ``sampled`` whose id goes there.
    :param vocab_size: ids are clamped into ``[0, vocab_size)``: a row that drew no valid id (its request ends
        with an error when the step's result is read) still feeds a valid one to the step already launched.
    """

    def __init__(self, sampled: torch.Tensor, positions: list[int], rows: list[int], vocab_size: int) -> None:
        self.sampled, self.positions, self.rows, self.vocab_size = sampled, positions, rows, vocab_size

    def fill(self, ids: torch.Tensor, upload: Callable[[list[Any], torch.dtype], torch.Tensor]) -> None:
        """Write the fed ids into ``ids`` (the next step's, on the device), in place; ``upload`` stages the indices
        (the runner's: page-locked where the platform has it, so the copy does not wait for the step in flight)."""
        if not self.positions:
            return
        where = upload([*self.positions, *self.rows], torch.int64)
        at, rows = where.split([len(self.positions), len(self.rows)])
        ids.index_copy_(0, at, self.sampled.index_select(0, rows).clamp(0, self.vocab_size - 1).to(ids.dtype))


class PendingStep:
    """A launched step (:meth:`ModelRunner.launch`): its sampled ids on the device until :meth:`result` reads them."""

    def __init__(
        self,
        runner: ModelRunner | None,
        batch: StepBatch | None,
        sampled: Any = None,
        finite: Any = None,
        logits: Any = None,
        captured: bool = False,
        rerun: Callable[[], Any] | None = None,
        prompt_rows: Any = None,
        prompt_logits: Any = None,
    ) -> None:
        self.runner, self.batch = runner, batch
        self.sampled, self.finite, self.logits = sampled, finite, logits
        #: replayed from a captured graph: ``logits`` is the graph's output buffer, which the next replay overwrites
        self.captured = captured
        self.rerun = rerun or (lambda: None)
        self.prompt_rows, self.prompt_logits = prompt_rows, prompt_logits
        self.launch = runner.num_launches if runner is not None else 0
        self._result: list[int | TokenError] | None = None
        #: ``[2, rows]``: the sampled ids over the finite flags, on the device or (with ``copied``, the event after
        #: the copy) copied to page-locked host memory at launch
        self.ids_and_flags: torch.Tensor | None = None
        self.copied: Any = None

    @classmethod
    def ready(cls, result: list[int | TokenError]) -> PendingStep:
        """A step whose result is known at launch (no sampling rows, or nothing to run)."""
        pending = cls(None, None)
        pending._result = result
        return pending

    def feed(self, positions: list[int], rows: list[int]) -> StepFeed:
        """A feed of the next step's ``positions`` from this step's sampled ``rows``."""
        return StepFeed(self.sampled, positions, rows, self.logits.shape[-1])

    def result(self) -> list[int | TokenError]:
        """The token (or :class:`TokenError`) of each of the batch's sampling rows, waiting for the device once."""
        if self._result is None:
            assert self.runner is not None
            self._result = self.runner._result(self)
            self.sampled = self.finite = self.logits = self.prompt_logits = self.ids_and_flags = None  # memory back
        return self._result
