"""Pipeline parallelism for the engine: the model's layers in stages over ranks, the residual stream sent on.

Rank ``r`` of ``p`` holds the decoder layers :func:`stage_layers` gives it (``split_range``'s rule:
the first ``num_layers % p`` stages one layer more), their KV cache, and the ends of the model it
needs: the first stage the embedding, the last the final norm and the LM head
(:class:`~vllm_port.models.llama.ModelPart`). Each rank reads only its own tensors from the checkpoint,
so a model whose weights do not fit one device's memory runs on ``p`` devices that hold 1/p each.

A step goes through the stages in turn. Every rank gets the step's
:class:`~vllm_port.engine.scheduler.StepBatch` (the same cache slots: each rank's cache holds its
own layers' keys and values of the same blocks). The first stage embeds the tokens; each stage runs
its layers (:meth:`LlamaModel.forward_layers`) and sends the residual stream ``[tokens, hidden]`` to
the next rank through the comm contract's point-to-point (``send``/``recv``); the last stage
normalises it, computes the logits and samples, and its ids are the step's. The residual is what a
single process carries from layer to layer too, so the stages compute what one process does.

What it does not do yet: keep several batches in flight. Within a step the stages take turns and
each device idles while the others compute, so a batch is no faster than on one device (slower by
the transfers); pipeline parallelism here buys memory, not speed. Its steps run eagerly (a step's
``recv`` and ``send`` are not captured as graphs), and it combines with neither tensor parallelism
nor placement.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from ..models import LlamaModel, ModelConfig, load_config, load_weights
from ..models.llama import ModelPart
from ..ops import BoundOps
from ..sharded_layers import split_range
from .tensor_parallel import TensorParallelRunner

__all__ = [
    "PipelineParallelRunner",
    "check_stageable",
    "load_stage",
    "stage_config",
    "stage_filter",
    "stage_layers",
    "stage_step",
]

_LAYERS = "model.layers."


def check_stageable(config: ModelConfig, pipeline_parallel_size: int) -> None:
    """Refuse a split into more stages than the model has layers.

    :raises ValueError: naming ``num_hidden_layers`` and the largest size that works.
    """
    if pipeline_parallel_size < 1:
        raise ValueError(f"pipeline_parallel_size is {pipeline_parallel_size}; it must be >= 1")
    if pipeline_parallel_size > config.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pipeline_parallel_size} is more stages than the model's {config.num_layers} "
            f"layers (num_hidden_layers); every stage holds one layer at least: use at most {config.num_layers}"
        )


def stage_layers(num_layers: int, rank: int, pipeline_parallel_size: int) -> tuple[int, int]:
    """``[start, end)`` of the decoder layers stage ``rank`` holds."""
    return split_range(num_layers, rank, pipeline_parallel_size)


def stage_config(config: ModelConfig, start: int, end: int) -> ModelConfig:
    """The config of the stage holding layers ``[start, end)``: those layers alone, numbered from 0."""
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[start:end])
    return dataclasses.replace(config, num_layers=end - start, moe=moe)


def _part(rank: int, pipeline_parallel_size: int) -> ModelPart:
    return ModelPart(embedding=rank == 0, head=rank == pipeline_parallel_size - 1)


def stage_filter(config: ModelConfig, start: int, end: int, part: ModelPart) -> Callable[[str], bool]:
    """Which checkpoint tensors (by Hugging Face name) the stage of layers ``[start, end)`` and ends ``part`` reads."""
    ends = set()
    if part.embedding or (part.head and config.tie_word_embeddings):
        ends.add("model.embed_tokens.weight")
    if part.head:
        ends |= {"model.norm.weight", "lm_head.weight"}

    def keep(name: str) -> bool:
        if name.startswith(_LAYERS):
            return start <= int(name[len(_LAYERS) :].split(".", 1)[0]) < end
        return name in ends

    return keep


def _renumbered(weights: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    """``weights`` with each layer's tensors named from ``model.layers.0`` (the stage's own numbering); empties it."""
    out = {}
    for name in list(weights):
        tensor = weights.pop(name)
        if name.startswith(_LAYERS):
            index, rest = name[len(_LAYERS) :].split(".", 1)
            name = f"{_LAYERS}{int(index) - start}.{rest}"
        out[name] = tensor
    return out


def load_stage(
    model_dir: str | os.PathLike[str],
    device: torch.device,
    dtype: torch.dtype,
    rank: int,
    pipeline_parallel_size: int,
    max_positions: int | None = None,
) -> LlamaModel:
    """Stage ``rank``'s model: its layers' tensors (and its ends') read from the checkpoint straight to ``device``.

    ``max_positions``: the rotary table's rows (default the config's ``max_position_embeddings``).
    """
    config = load_config(model_dir)
    check_stageable(config, pipeline_parallel_size)
    start, end = stage_layers(config.num_layers, rank, pipeline_parallel_size)
    part = _part(rank, pipeline_parallel_size)
    weights = load_weights(model_dir, config, device, dtype, keep=stage_filter(config, start, end, part))
    local = stage_config(config, start, end)
    return LlamaModel(local, _renumbered(weights, start), consume=True, max_positions=max_positions, part=part)


def stage_step(model: LlamaModel, ops: BoundOps, communicator: Any, rank: int, pipeline_parallel_size: int) -> Any:
    """The step function (:data:`~vllm_port.engine.runner.StepFunction`) of stage ``rank``.

    The first stage embeds the step's tokens, the others receive the residual stream from the rank
    before; a stage before the last sends its residual on and returns ``None``, the last returns the
    logits of ``logits_rows``.
    """
    first, last = rank == 0, rank == pipeline_parallel_size - 1
    hidden_size = model.config.hidden_size

    def step(input_ids, positions, kv_caches, meta, logits_rows):
        if first:
            residual = ops.embedding(input_ids, model.embed_tokens)
        else:
            residual = torch.empty((input_ids.shape[0], hidden_size), dtype=model.dtype, device=input_ids.device)
            communicator.recv(residual, rank - 1)
        hidden, residual = model.forward_layers(ops, residual, positions, kv_caches, meta)
        if not last:
            communicator.send(residual, rank + 1)
            return None
        return model.compute_logits(ops, hidden.index_select(0, logits_rows))

    return step


def _pipeline_stage(runtime: Any, ctx: Any, spec: dict[str, Any], runner_kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """Stage ``ctx.rank``'s runner, and whether its sampled ids are the step's (the last stage's are)."""
    from .runner import ModelRunner

    max_positions = runner_kwargs.pop("max_positions", None)  # the stage is loaded here, with its rotary table
    model = load_stage(spec["model_dir"], ctx.device, spec["dtype"], ctx.rank, ctx.world_size, max_positions)
    ops = runtime.bind(spec["dtype"])
    communicator = runtime.communicator()

    def make_step(runner: ModelRunner) -> Any:
        return stage_step(model, ops, communicator, ctx.rank, ctx.world_size)

    runner = ModelRunner(runtime, model, ops=ops, device=ctx.device, make_step=make_step, **runner_kwargs)
    return runner, ctx.rank == ctx.world_size - 1


class PipelineParallelRunner(TensorParallelRunner):
    """The runner interface of :class:`~vllm_port.engine.runner.ModelRunner` over ``world_size`` pipeline stages.

    Spawned and driven as the tensor-parallel workers are (every step to every rank); the last stage
    answers with the sampled ids, the others run their step's forward only.
    """

    mode = "pipeline parallel"
    rank_runner = staticmethod(_pipeline_stage)
    forward_only = True

    @staticmethod
    def check(config: ModelConfig, world_size: int) -> None:
        """Refuse more stages than layers (:func:`check_stageable`)."""
        check_stageable(config, world_size)

    def capture_steps(self, max_rows: int, max_model_len: int, max_prefill_tokens: int | None = None) -> list[int]:
        """Nothing is captured: a stage's step receives from and sends to other ranks, so every step runs eagerly."""
        return []
