"""Tensor or pipeline parallelism over ranks that a launcher started: ``torchrun``, on one machine or several.

``LLM(tensor_parallel_size=N, distributed_executor_backend="external_launcher")`` (vLLM's name for
the same mode) makes this process one of the ``N`` ranks ``torchrun`` launched: every rank runs the
same program, joins the platform's process group from ``torchrun``'s environment
(:meth:`vllm_port.runtime.Runtime.init_process_group`), loads its shard, and runs a whole engine of
its own: its scheduler makes the same choices as every other rank's, so the ranks step together
with no driver process and no queue. Across machines that is ``torchrun --nnodes N`` and nothing
else (docs/multi-node.md). With ``pipeline_parallel_size=N`` instead, each rank is a pipeline stage
(:mod:`~vllm_port.engine.pipeline_parallel`): its layers, the residual stream received from the
stage before and sent to the next; the last stage samples.

What keeps the ranks in step, checked rather than assumed:

- The KV pools: each rank sizes its cache from its own device's memory, so the scheduler's books
  are kept for the smallest cache of any rank (the others hold at least as many blocks).
- The tokens: the sampling rank's tokens (and logprobs), as JSON (data, never pickled code), are
  broadcast every step and used by every rank, so a rank whose sampling would have drawn otherwise
  (another seed) still follows it. That rank is rank 0 with tensor parallelism, the last stage with
  pipeline parallelism (the others compute no logits).
- The steps: before each step the ranks gather a digest of it (its tokens, positions, cache slots
  and lengths); where a rank's step differs from rank 0's (another prompt, other parameters, another
  program) every rank stops with an error naming it, before the step's collectives could mix shards of
  different batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import VllmPortError
from ..models import load_config
from .pipeline_parallel import check_stageable, load_stage, stage_step
from .runner import ModelRunner
from .scheduler import StepBatch, StepResult, TokenError, TopLogprobs
from .tensor_parallel import TensorParallelOps, check_shardable, load_shard

__all__ = ["LaunchedRankRunner"]


class LaunchedRankRunner:
    """The runner interface of :class:`~vllm_port.engine.runner.ModelRunner` for this process as one launched rank.

    :param pipeline: the ranks are pipeline stages (``pipeline_parallel_size``), not tensor-parallel shards.
    :raises ValueError: when ``torchrun``'s ``WORLD_SIZE`` is missing or is not ``world_size``.
    :raises CommInitError: when the process group cannot be joined (the environment names what is missing).
    """

    def __init__(
        self,
        runtime: Any,
        model_dir: str | os.PathLike[str],
        dtype: torch.dtype,
        world_size: int,
        *,
        pipeline: bool = False,
        block_size: int = 16,
        timeout_s: float = 300.0,
        **runner_kwargs: Any,
    ) -> None:
        launched = os.environ.get("WORLD_SIZE")
        size = "pipeline_parallel_size" if pipeline else "tensor_parallel_size"
        if launched != str(world_size):
            found = f"$WORLD_SIZE is {launched!r}" if launched is not None else "$WORLD_SIZE is not set"
            raise ValueError(
                f"distributed_executor_backend='external_launcher' with {size}={world_size}: {found}; "
                f"start every rank with a launcher that sets it, e.g. torchrun --nproc-per-node {world_size} "
                f"(on several machines: torchrun --nnodes M --nproc-per-node {world_size}/M ...), "
                f"or use the default backend, which spawns the ranks on this machine"
            )
        (check_stageable if pipeline else check_shardable)(load_config(model_dir), world_size)
        self.block_size = block_size
        self.world_size = world_size
        self.pipeline = pipeline
        context = runtime.init_process_group(timeout_s)
        self.rank, self.device = context.rank, context.device
        #: the rank whose sampled tokens every rank uses: the last stage's in a pipeline, else rank 0's
        self.sampler = world_size - 1 if pipeline else 0
        max_positions = runner_kwargs.pop("max_positions", None)  # the model is loaded here, with its rotary table
        self._communicator = runtime.communicator()
        if pipeline:
            model = load_stage(Path(model_dir), context.device, dtype, context.rank, world_size, max_positions)
            ops = runtime.bind(dtype)
            step = stage_step(model, ops, self._communicator, context.rank, world_size)
            runner_kwargs["make_step"] = lambda runner: step
        else:
            model = load_shard(Path(model_dir), context.device, dtype, context.rank, world_size, max_positions)
            row = [w for layer in model.layers for w in (layer.o_weight, layer.down_weight)]
            ops = TensorParallelOps(runtime.bind(dtype), self._communicator, row)
        self._runner = ModelRunner(
            runtime, model, ops=ops, device=context.device, block_size=block_size, **runner_kwargs
        )
        #: the provider bound to each op (every rank binds the same)
        self.provider_per_op: dict[str, str] = self._runner.provider_per_op
        own = self._runner.swap_pool.num_blocks if self._runner.swap_pool is not None else 0
        blocks, swap_blocks = self._smallest(self._runner.pool.num_blocks, own)
        factory = runtime.block_pool_factory()
        self.pool = factory(blocks, 1, block_size)
        self.swap_pool = factory(swap_blocks, 1, block_size) if swap_blocks else None
        self.num_steps = 0

    def _smallest(self, *counts: int) -> list[int]:
        """Each of ``counts`` as the smallest any rank has."""
        mine = torch.tensor([counts], dtype=torch.int64, device=self.device)
        return self._communicator.all_gather(mine).min(dim=0).values.tolist()

    def capture_steps(self, max_rows: int, max_model_len: int, max_prefill_tokens: int | None = None) -> list[int]:
        """This rank captures its step (:meth:`ModelRunner.capture_steps`); the sizes it captured. A pipeline
        stage captures nothing: its step receives from and sends to other ranks."""
        if self.pipeline:
            return []
        return self._runner.capture_steps(max_rows, max_model_len, max_prefill_tokens)

    def execute(self, batch: StepBatch) -> Any:
        """Run the step on this rank's shard or stage; return the sampling rank's tokens, the same on every rank.

        :raises VllmPortError: when this rank's step is not rank 0's (the ranks run different programs or
            prompts), before any of the step's collectives could mix shards of different batches.
        """
        if batch.query_lens:
            self.num_steps += 1
            self._check_step(batch)
        if self.rank != self.sampler and self.pipeline:  # a stage before the last: no logits, nothing sampled
            self._runner.forward(batch)
            sampled: Any = []
        else:
            sampled = self._runner.execute(batch)
        return self._from_sampler(sampled) if batch.query_lens else sampled

    def _check_step(self, batch: StepBatch) -> None:
        """Every rank's digest of its step, gathered: any rank whose step is not rank 0's stops every rank."""
        mine = torch.frombuffer(bytearray(_digest(batch)), dtype=torch.uint8).to(self.device)
        every = self._communicator.all_gather(mine[None])
        differ = [r for r in range(self.world_size) if not torch.equal(every[r], every[0])]
        if differ:
            raise VllmPortError(
                f"external launcher: step {self.num_steps} of rank(s) {differ} is not rank 0's (other tokens, positions "
                "or cache slots): every rank must run the same program with the same prompts, sampling parameters and "
                "engine arguments, in the same order"
            )

    def _from_sampler(self, sampled: Any) -> Any:
        """The sampling rank's ``sampled`` on every rank: as JSON (:func:`_encode`), one broadcast of its length,
        one of its bytes."""
        mine = self.rank == self.sampler
        payload = torch.frombuffer(bytearray(_encode(sampled)), dtype=torch.uint8) if mine else None
        size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=self.device)
        size = self._communicator.broadcast(size, self.sampler)
        data = (
            payload.to(self.device)
            if payload is not None
            else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        )
        data = self._communicator.broadcast(data, self.sampler)
        return _decode(bytes(data.cpu().tolist()))

    def close(self) -> None:
        """Give this rank's cache back and leave the process group."""
        self._runner.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _encode(sampled: Any) -> bytes:
    """A step's result (tokens or :class:`TokenError` s, and a :class:`StepResult`'s logprobs) as JSON: data, never code."""
    tokens = [t if isinstance(t, int) else {"error": t.message, "cache_suspect": t.cache_suspect} for t in sampled]
    found: dict[str, Any] = {"tokens": tokens}
    if isinstance(sampled, StepResult):
        found["logprobs"] = {str(row): _top(lp) for row, lp in sampled.logprobs.items()}
        found["prompt_logprobs"] = {
            str(seq): [[pos, _top(lp)] for pos, lp in rows] for seq, rows in sampled.prompt_logprobs.items()
        }
    return json.dumps(found).encode()


def _top(lp: TopLogprobs) -> list[Any]:
    return [lp.token_id, lp.logprob, lp.rank, [list(pair) for pair in lp.top]]


def _from_top(fields: list[Any]) -> TopLogprobs:
    token_id, logprob, rank, top = fields
    return TopLogprobs(token_id, logprob, rank, tuple((int(t), float(v)) for t, v in top))


def _decode(data: bytes) -> Any:
    """:func:`_encode`'s result back: a list, or a :class:`StepResult` where it carried logprobs."""
    found = json.loads(data)
    tokens = [t if isinstance(t, int) else TokenError(t["error"], t["cache_suspect"]) for t in found["tokens"]]
    if "logprobs" not in found:
        return tokens
    logprobs = {int(row): _from_top(lp) for row, lp in found["logprobs"].items()}
    prompt = {int(seq): [(pos, _from_top(lp)) for pos, lp in rows] for seq, rows in found["prompt_logprobs"].items()}
    return StepResult(tokens, logprobs, prompt)


def _digest(batch: StepBatch) -> bytes:
    """What every rank's step must share: tokens, positions, cache slots, tables, lengths, rows sampled."""
    parts = (batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables, batch.seq_lens,
             batch.query_lens, batch.sample_rows, batch.swap_out, batch.swap_in, batch.copies)  # fmt: skip
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()
