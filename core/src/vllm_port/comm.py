"""The comm contract: point-to-point and collectives, two parts a plugin may replace one at a time.

The defaults run on ``torch.distributed`` with the platform's backend (gloo, nccl, rccl, xccl), in
the process group ``torchrun`` sets up: an existing distributed engine, not a home-made one.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Collectives", "Communicator", "PointToPoint", "TorchCollectives", "TorchPointToPoint"]


class PointToPoint(abc.ABC):
    """Tensor transfers between two ranks."""

    name: str = "point_to_point"

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``; returns when the buffer may be reused."""

    @abc.abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from rank ``src``."""

    @abc.abstractmethod
    def batch_isend_irecv(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        """Post all sends ``(tensor, dst)`` and receives ``(tensor, src)`` together, then wait for all."""


class Collectives(abc.ABC):
    """Collective operations over all ranks of the group."""

    name: str = "collectives"

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; return it."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``."""

    @abc.abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then return this rank's slice of ``dim`` (split evenly)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``, in place; return it."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""


@dataclass(frozen=True)
class Communicator:
    """The two comm parts bound for a platform; ``served_by`` says which implementation serves each."""

    point_to_point: PointToPoint
    collectives: Collectives

    @property
    def served_by(self) -> dict[str, str]:
        return {"point_to_point": self.point_to_point.name, "collectives": self.collectives.name}


class TorchPointToPoint(PointToPoint):
    """Point-to-point on ``torch.distributed``'s default process group."""

    name = "torch.distributed"

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        dist.send(tensor.contiguous(), dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        dist.recv(tensor, src)

    def batch_isend_irecv(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends] + [
            dist.P2POp(dist.irecv, t, peer) for t, peer in recvs
        ]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


class TorchCollectives(Collectives):
    """Collectives on ``torch.distributed``'s default process group."""

    name = "torch.distributed"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        chunks = [c.contiguous() for c in tensor.chunk(dist.get_world_size(), dim=dim)]
        out = torch.empty_like(chunks[dist.get_rank()])
        dist.reduce_scatter(out, chunks)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src)
        return tensor

    def barrier(self) -> None:
        dist.barrier()
