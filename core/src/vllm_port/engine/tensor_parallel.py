"""Tensor parallelism for the engine: the model's linear layers sharded over ranks, through the comm contract.

The model stays one definition. Each rank builds a :class:`~vllm_port.models.LlamaModel` from its
shard of the weights and a config with its share of the heads and of the MLP's width (column
parallel: q/k/v and gate/up split by output rows; row parallel: o_proj and down_proj split by input
columns), with :func:`~vllm_port.sharded_layers.split_range`'s rule. The only other difference is in the
ops it is given: :class:`TensorParallelOps` is the bound kernels with a ``linear`` that sums the
partial products of the row-parallel weights over the ranks (``all_reduce`` of the communicator)
before adding their bias. Embedding, norms and LM head are replicated, so every rank computes the
same logits and samples the same tokens; rank 0's are used.

Key/value heads: with ``num_kv_heads`` divisible by the ranks each rank caches its own; with fewer
heads than ranks (ranks a multiple of them) each rank keeps the one its query heads read.

Processes: ``LLM(tensor_parallel_size=n)`` spawns ``n`` worker processes on this host, each one rank
of the platform's process group (:meth:`vllm_port.runtime.Runtime.init_process_group`), with its runner and cache.
The scheduler stays in the caller's process and keeps the books of one block pool for all ranks
(each rank's cache has at least as many blocks); every step's :class:`StepBatch` goes to every
rank through a queue, and rank 0 sends back the sampled ids.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import VllmPortError
from ..models import LlamaModel, ModelConfig, load_config, load_weights
from ..ops import BoundOps
from ..sharded_layers import split_range
from .scheduler import StepBatch

__all__ = ["TensorParallelOps", "TensorParallelRunner", "check_shardable", "shard_config", "shard_weights"]

#: Seconds a worker may take to start (import, join the group, load its shard) before the engine gives up.
START_TIMEOUT_S = 600.0


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Refuse a model whose heads or MLP width do not split evenly over ``world_size`` ranks.

    :raises ValueError: naming the config field and the sizes that would work.
    """
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size is {world_size}; it must be >= 1")
    if config.moe is not None and world_size > 1:
        field = "num_local_experts" if config.architecture == "MixtralForCausalLM" else "num_experts"
        raise ValueError(
            f"tensor_parallel_size={world_size}: {config.architecture} is a mixture-of-experts model (config field "
            f"{field!r}), whose experts are not split over ranks yet (expert parallelism: docs/ops.md); run it with "
            "tensor_parallel_size=1"
        )
    problems = []
    if config.num_heads % world_size:
        problems.append(f"num_attention_heads={config.num_heads}")
    if config.intermediate_size % world_size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        problems.append(f"num_key_value_heads={kv} (neither divisible by the ranks nor dividing them)")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not split {', '.join(problems)} evenly; "
            "use a number of ranks that divides them"
        )


def _kv_heads(config: ModelConfig, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of the key/value heads rank ``rank`` keeps."""
    if config.num_kv_heads % world_size == 0:
        return split_range(config.num_kv_heads, rank, world_size)
    q_start, _ = split_range(config.num_heads, rank, world_size)
    head = q_start // (config.num_heads // config.num_kv_heads)  # the one key/value head its query heads read
    return head, head + 1


def shard_config(config: ModelConfig, rank: int, world_size: int) -> ModelConfig:
    """The config of rank ``rank``'s shard: its query and key/value heads, its part of the MLP."""
    check_shardable(config, world_size)
    kv_start, kv_end = _kv_heads(config, rank, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=kv_end - kv_start,
        intermediate_size=config.intermediate_size // world_size,
    )


def shard_weights(
    config: ModelConfig, weights: dict[str, torch.Tensor], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors, by Hugging Face name, cut from the full ``weights`` (which it empties)."""
    hd = config.head_size
    q0, q1 = (x * hd for x in split_range(config.num_heads, rank, world_size))
    k0, k1 = (x * hd for x in _kv_heads(config, rank, world_size))
    m0, m1 = split_range(config.intermediate_size, rank, world_size)
    rows = {"q_proj": (q0, q1), "k_proj": (k0, k1), "v_proj": (k0, k1), "gate_proj": (m0, m1), "up_proj": (m0, m1)}
    cols = {"o_proj": (q0, q1), "down_proj": (m0, m1)}
    out = {}
    for name in list(weights):
        tensor = weights.pop(name)
        part = name.split(".")[-2] if name.startswith("model.layers.") else ""
        if part in rows:
            tensor = tensor[slice(*rows[part])]  # weight rows, or the bias
        elif part in cols and name.endswith(".weight"):
            tensor = tensor[:, slice(*cols[part])]  # o_proj's bias is added once, after the reduction
        out[name] = tensor.contiguous()
    return out


class TensorParallelOps:
    """Bound kernels whose ``linear`` all-reduces the partial products of row-parallel weights.

    :param ops: the kernels bound for the model's dtype.
    :param communicator: the platform's communicator, in the process group of the ranks.
    :param row_parallel: the weights split along their input dim (o_proj, down_proj of every layer).
    """

    def __init__(self, ops: BoundOps, communicator: Any, row_parallel: Iterable[torch.Tensor]) -> None:
        for name in ops.providers:
            setattr(self, name, getattr(ops, name))
        self.providers = ops.providers
        self.context = ops.context
        self._linear = ops.linear
        self._communicator = communicator
        self._row_parallel = {id(w) for w in row_parallel}
        self.linear = self._parallel_linear

    def _parallel_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if id(weight) not in self._row_parallel:
            return self._linear(x, weight, bias)
        partial = self._communicator.all_reduce(self._linear(x, weight, None))
        return partial if bias is None else partial + bias


def load_shard(
    model_dir: str | os.PathLike[str],
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    world_size: int,
    max_positions: int | None = None,
) -> LlamaModel:
    """Rank ``rank``'s model: the full weights read to host memory, cut, and the shard moved to ``device``.

    ``max_positions``: the rotary table's rows (default the config's ``max_position_embeddings``).
    """
    config = load_config(model_dir)
    local = shard_config(config, rank, world_size)
    full = load_weights(model_dir, config, torch.device("cpu"), dtype)
    shard = {k: v.to(device) for k, v in shard_weights(config, full, rank, world_size).items()}
    return LlamaModel(local, shard, consume=True, max_positions=max_positions)


# -------------------------------------------------------------------------------------------------
# Worker processes
# -------------------------------------------------------------------------------------------------


def _tensor_rank(runtime: Any, ctx: Any, spec: dict[str, Any], runner_kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """Rank ``ctx.rank``'s runner over its shard, and whether its sampled ids are the step's (rank 0's are)."""
    from .runner import ModelRunner

    max_positions = runner_kwargs.pop("max_positions", None)  # the shard is loaded here, with its rotary table
    model = load_shard(spec["model_dir"], ctx.device, spec["dtype"], ctx.rank, ctx.world_size, max_positions)
    row = [w for layer in model.layers for w in (layer.o_weight, layer.down_weight)]
    ops = TensorParallelOps(runtime.bind(spec["dtype"]), runtime.communicator(), row)
    return ModelRunner(runtime, model, ops=ops, device=ctx.device, **runner_kwargs), ctx.rank == 0


def _worker(
    rank: int,
    world_size: int,
    port: int,
    spec: dict[str, Any],
    inbox: Any,
    outbox: Any,
) -> None:
    """One rank: join the group, build its runner (``spec["rank"]``: :func:`_tensor_rank`, or a pipeline stage's),
    then run every step the engine sends until ``None``.

    The rank whose sampled ids are the step's sends them back; a runner without ``sample_steps`` (a pipeline
    stage before the last) only runs its step's forward.
    """
    from ..spawn import set_rank_environment

    set_rank_environment(rank, world_size, port)
    try:
        from ..runtime import load

        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        runtime = load(spec["plugins"], spec["platform"])
        ctx = runtime.init_process_group(spec["timeout_s"])
        runner, answers = spec["rank"](runtime, ctx, spec, dict(spec["runner"]))
        swap_blocks = runner.swap_pool.num_blocks if runner.swap_pool is not None else 0
        outbox.put(("ready", rank, (runner.pool.num_blocks, swap_blocks, runner.provider_per_op)))
        run = runner.execute if answers or not spec["forward_only"] else runner.forward
        while (batch := inbox.get()) is not None:
            if isinstance(batch, tuple):  # ("capture", max_rows, max_model_len, max_prefill_tokens)
                outbox.put(("captured", rank, runner.capture_steps(*batch[1:])))
                continue
            sampled = run(batch)
            if answers and batch.query_lens:
                outbox.put(("sampled", rank, sampled))
        runner.close()
    except BaseException as exc:
        outbox.put(("error", rank, _portable(exc)))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` when it is a VllmPortError that survives pickling (the caller can catch it), else its traceback as text."""
    if isinstance(exc, VllmPortError):
        try:
            return pickle.loads(pickle.dumps(exc))  # noqa: S301 - our own exception, made in this process
        except Exception:  # an exception whose constructor takes other arguments than its message
            return VllmPortError(f"{type(exc).__name__}: {exc}")
    return RuntimeError("".join(traceback.format_exception(exc)))


class TensorParallelRunner:
    """The runner interface of :class:`~vllm_port.engine.runner.ModelRunner` over ``world_size`` worker ranks."""

    #: what the errors of its workers call the mode
    mode = "tensor parallel"
    #: each worker's runner (see :func:`_worker`)
    rank_runner = staticmethod(_tensor_rank)
    #: whether the ranks that do not answer run only their step's forward (the TP ranks sample, and drop it)
    forward_only = False

    @staticmethod
    def check(config: ModelConfig, world_size: int) -> None:
        """Refuse a model the ranks cannot split (:func:`check_shardable`)."""
        check_shardable(config, world_size)

    def __init__(
        self,
        runtime: Any,
        model_dir: str | os.PathLike[str],
        dtype: torch.dtype,
        world_size: int,
        *,
        block_size: int = 16,
        timeout_s: float = 300.0,
        **runner_kwargs: Any,
    ) -> None:
        import torch.multiprocessing as mp

        from ..spawn import free_port

        self.check(load_config(model_dir), world_size)
        self.runtime = runtime
        self.block_size = block_size
        self.world_size = world_size
        excluded = runtime.discovery.excluded
        spec = {
            "model_dir": str(Path(model_dir)),
            "dtype": dtype,
            "platform": runtime.platform.name,
            "plugins": ",".join(f"-{name}" for name in excluded) or None,
            "timeout_s": timeout_s,
            "threads": torch.get_num_threads(),
            "runner": dict(runner_kwargs, block_size=block_size),
            "rank": self.rank_runner,
            "forward_only": self.forward_only,
        }
        context = mp.get_context("spawn")
        self._outbox = context.Queue()
        self._inboxes = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [
            context.Process(
                target=_worker, args=(r, world_size, port, spec, self._inboxes[r], self._outbox), daemon=True
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        try:
            ready = [self._receive("ready", START_TIMEOUT_S) for _ in range(world_size)]
        except BaseException:
            self.close()
            raise
        #: the provider bound to each op (every rank binds the same)
        self.provider_per_op: dict[str, str] = ready[0][2]
        factory = runtime.block_pool_factory()
        num_blocks = min(b for b, _, _ in ready)
        swap_blocks = min(s for _, s, _ in ready)
        self.pool = factory(num_blocks, 1, block_size)
        self.swap_pool = factory(swap_blocks, 1, block_size) if swap_blocks else None

    def _receive(self, kind: str, timeout_s: float) -> Any:
        waited = 0.0
        while True:
            try:
                got, rank, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None]
                if dead or waited >= timeout_s:
                    raise VllmPortError(
                        f"{self.mode}: rank(s) {dead} exited" if dead else f"no rank answered in {timeout_s:.0f} s"
                    ) from None
                continue
            if got == "error":
                raise value
            if got != kind:
                raise VllmPortError(f"{self.mode}: rank {rank} sent {got!r} where {kind!r} was expected")
            return value

    def capture_steps(self, max_rows: int, max_model_len: int, max_prefill_tokens: int | None = None) -> list[int]:
        """Every rank captures its step (:meth:`ModelRunner.capture_steps`); the sizes captured."""
        for inbox in self._inboxes:
            inbox.put(("capture", max_rows, max_model_len, max_prefill_tokens))
        sizes = [self._receive("captured", START_TIMEOUT_S) for _ in range(self.world_size)]
        return min(sizes, key=len)

    def execute(self, batch: StepBatch) -> list[int]:
        """Run the step on every rank; return rank 0's sampled ids."""
        for inbox in self._inboxes:
            inbox.put(batch)
        if not batch.query_lens:
            return []
        return self._receive("sampled", float("inf"))

    def close(self) -> None:
        """Stop the workers (each gives its cache back and leaves the process group)."""
        for inbox, proc in zip(self._inboxes, self._procs, strict=True):
            if proc.is_alive():
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
