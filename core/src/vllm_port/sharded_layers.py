"""Tensor-parallel building blocks: each holds its rank's shard and runs on bound ops and the communicator.

Sharding rule (every class, even and uneven sizes alike): a dim of size ``n`` split over ``w`` ranks
gives rank ``r`` the range of ``torch.tensor_split``: the first ``n % w`` ranks get ``n // w + 1``
rows, the rest ``n // w`` (:func:`split_range`). A shard may be empty (``n < w``). Layers are built
from the full weight on load with ``Cls.shard(full_weight, rank, world_size, ...)``.

* :class:`ColumnParallelLinear`: ``W [out, in]`` split along ``out``; ``y`` comes out split along its
  last dim, gathered when ``gather_output``. ``output_sizes`` shards each piece of a merged weight
  (gate and up of an MLP) on its own, so ``silu_and_mul`` works on the local shard.
* :class:`RowParallelLinear`: ``W [out, in]`` split along ``in``; the input comes split along its
  last dim (the column-parallel output), partial products are summed with ``all_reduce``, then the
  (unsharded) bias is added once.
* :class:`VocabParallelEmbedding`: the table split along the vocabulary; ids outside the shard give
  zero rows, then ``all_reduce`` assembles every row.
* :class:`ParallelLMHead`: the output projection split along the vocabulary; logits are gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .comm import Communicator

__all__ = [
    "ColumnParallelLinear",
    "ParallelLMHead",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "shard_dim",
    "split_range",
]


def split_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s part of a dim of ``size`` split over ``world_size`` ranks."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def shard_dim(tensor: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous copy of ``tensor`` split along ``dim`` (:func:`split_range`)."""
    start, end = split_range(tensor.shape[dim], rank, world_size)
    return tensor.narrow(dim, start, end - start).contiguous()


def _shard_pieces(
    full: torch.Tensor, sizes: Sequence[int] | None, dim: int, rank: int, world_size: int
) -> torch.Tensor:
    if sizes is None:
        return shard_dim(full, dim, rank, world_size)
    if sum(sizes) != full.shape[dim]:
        raise ValueError(f"output_sizes {list(sizes)} do not add up to the weight's {full.shape[dim]} rows")
    return torch.cat([shard_dim(p, dim, rank, world_size) for p in full.split(list(sizes), dim)], dim)


@dataclass
class ColumnParallelLinear:
    """``y = x @ W.T + b`` with ``W``'s output rows split over ranks."""

    weight: torch.Tensor  # [out_shard, in]
    bias: torch.Tensor | None
    rank: int
    world_size: int
    gather_output: bool = False

    @classmethod
    def shard(
        cls,
        full_weight: torch.Tensor,
        rank: int,
        world_size: int,
        bias: torch.Tensor | None = None,
        gather_output: bool = False,
        output_sizes: Sequence[int] | None = None,
    ) -> ColumnParallelLinear:
        """This rank's layer from the full ``[out, in]`` weight (and ``[out]`` bias).

        :param output_sizes: sizes of the pieces of a merged weight (e.g. ``[inter, inter]`` for gate
            and up); each piece is split on its own and the local shards are concatenated. Gathering
            such an output would interleave the pieces, so it is refused.
        """
        if output_sizes is not None and gather_output:
            raise ValueError("gather_output with output_sizes would interleave the merged pieces; gather each piece")
        w = _shard_pieces(full_weight, output_sizes, 0, rank, world_size)
        b = None if bias is None else _shard_pieces(bias, output_sizes, 0, rank, world_size)
        return cls(w, b, rank, world_size, gather_output)

    def forward(self, x: torch.Tensor, kernels: Any, communicator: Communicator) -> torch.Tensor:
        y = kernels.linear(x, self.weight, self.bias)
        return communicator.all_gather(y, dim=-1) if self.gather_output and self.world_size > 1 else y


@dataclass
class RowParallelLinear:
    """``y = x @ W.T + b`` with ``W``'s input columns split over ranks; partial sums all-reduced."""

    weight: torch.Tensor  # [out, in_shard]
    bias: torch.Tensor | None  # full [out], added once after the reduction
    rank: int
    world_size: int
    input_is_parallel: bool = True

    @classmethod
    def shard(
        cls,
        full_weight: torch.Tensor,
        rank: int,
        world_size: int,
        bias: torch.Tensor | None = None,
        input_is_parallel: bool = True,
    ) -> RowParallelLinear:
        """This rank's layer from the full ``[out, in]`` weight; the bias stays whole."""
        return cls(shard_dim(full_weight, 1, rank, world_size), bias, rank, world_size, input_is_parallel)

    def forward(self, x: torch.Tensor, kernels: Any, communicator: Communicator) -> torch.Tensor:
        if not self.input_is_parallel:
            x = shard_dim(x, x.dim() - 1, self.rank, self.world_size)
        y = kernels.linear(x, self.weight, None)
        if self.world_size > 1:
            y = communicator.all_reduce(y)
        return y if self.bias is None else y + self.bias


@dataclass
class VocabParallelEmbedding:
    """Embedding lookup with the vocabulary split over ranks."""

    weight: torch.Tensor  # [vocab_shard, hidden]
    start: int  # first vocabulary id of the shard
    rank: int
    world_size: int

    @classmethod
    def shard(cls, full_weight: torch.Tensor, rank: int, world_size: int) -> VocabParallelEmbedding:
        start, _ = split_range(full_weight.shape[0], rank, world_size)
        return cls(shard_dim(full_weight, 0, rank, world_size), start, rank, world_size)

    def forward(self, input_ids: torch.Tensor, kernels: Any, communicator: Communicator) -> torch.Tensor:
        if self.world_size == 1:
            return kernels.embedding(input_ids, self.weight)
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        if self.weight.shape[0] == 0:  # an empty shard: contributes zeros
            out = self.weight.new_zeros((*input_ids.shape, self.weight.shape[1]))
        else:
            out = kernels.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
            out = out * inside.unsqueeze(-1).to(out.dtype)
        return communicator.all_reduce(out)


@dataclass
class ParallelLMHead:
    """Logits ``h @ W.T`` with the vocabulary split over ranks; gathered to full logits."""

    weight: torch.Tensor  # [vocab_shard, hidden]
    rank: int
    world_size: int

    @classmethod
    def shard(cls, full_weight: torch.Tensor, rank: int, world_size: int) -> ParallelLMHead:
        return cls(shard_dim(full_weight, 0, rank, world_size), rank, world_size)

    def forward(self, hidden: torch.Tensor, kernels: Any, communicator: Communicator) -> torch.Tensor:
        logits = kernels.linear(hidden, self.weight, None)
        return communicator.all_gather(logits, dim=-1) if self.world_size > 1 else logits
