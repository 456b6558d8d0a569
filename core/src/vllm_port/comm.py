"""The comm contract: point-to-point and collectives, two parts a plugin may replace one at a time.

The defaults run on ``torch.distributed`` with the platform's backend (gloo, nccl, rccl, xccl), in
the process group ``torchrun`` sets up (:func:`init_from_env`): an existing distributed engine, not a
home-made one.

The rules every call of the defaults follows:

* **Input.** The tensor must be a dense (strided) ``torch.Tensor`` of a supported dtype
  (:data:`SUPPORTED_DTYPES`); ranks and dims must be in range. Anything else raises
  :class:`~vllm_port.errors.CommInputError` naming the rank and the call, before any communication.
* **Non-contiguous input** is copied to a contiguous buffer; in-place calls (``all_reduce``,
  ``broadcast``, ``recv``) copy the result back into the caller's tensor, so views work.
* **all_gather** along ``dim``: every rank's tensor must have the same dtype, number of dims and
  size in every dim except ``dim``; sizes along ``dim`` may differ (uneven shards are padded to the
  largest for the transfer and trimmed after). Shapes are exchanged first (one small all_gather), so
  a mismatch raises :class:`~vllm_port.errors.CommShapeMismatchError` on every rank naming each
  rank's shape, instead of hanging or corrupting memory.
* **reduce_scatter** along ``dim``: every rank passes the same shape (checked like all_gather);
  rank ``r`` gets slice ``r`` of ``torch.tensor_split(sum, world_size, dim)``, so when the size is
  not divisible the first ``size % world_size`` ranks get one more row. Even splits use
  ``dist.reduce_scatter`` (gloo supports it in torch 2.13); uneven ones use ``all_reduce`` + slice.
* **all_reduce / broadcast** do not exchange shapes (they are on the hot path); ranks must pass
  equal shapes and dtypes, as in ``torch.distributed``.
* **A dead or absent peer** ends in :class:`~vllm_port.errors.CommTimeoutError` naming the rank and
  the call once the process group's timeout (``init_from_env(timeout_s=...)``) expires or the
  backend notices the peer is gone: never an endless hang.
* **Capabilities.** Each part lists the calls it serves in ``capabilities``; the
  :class:`Communicator` refuses any other with :class:`~vllm_port.errors.CommCapabilityError`.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .errors import (
    CommCapabilityError,
    CommError,
    CommInitError,
    CommInputError,
    CommShapeMismatchError,
    CommTimeoutError,
)
from .platform import PlatformDescription

__all__ = [
    "COLLECTIVE_CALLS",
    "P2P_CALLS",
    "SUPPORTED_DTYPES",
    "Collectives",
    "Communicator",
    "DistContext",
    "PointToPoint",
    "TorchCollectives",
    "TorchPointToPoint",
    "init_from_env",
]

P2P_CALLS = frozenset({"send", "recv", "batch_isend_irecv"})
COLLECTIVE_CALLS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier"})

#: dtypes the torch.distributed defaults accept (every backend vllm-port uses moves these)
SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
_MAX_DIMS = 8  # the shape exchange carries up to this many dims


class PointToPoint(abc.ABC):
    """Tensor transfers between two ranks."""

    name: str = "point_to_point"
    #: the calls this part serves; a subclass serving fewer narrows it
    capabilities: frozenset[str] = P2P_CALLS

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
    #: the calls this part serves; a subclass serving fewer narrows it
    capabilities: frozenset[str] = COLLECTIVE_CALLS

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks, in place; return it."""

    @abc.abstractmethod
    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` (sizes along ``dim`` may differ)."""

    @abc.abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then return this rank's slice of ``dim`` (``torch.tensor_split``'s split)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``, in place; return it."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""


@dataclass(frozen=True)
class Communicator:
    """The two comm parts bound for a platform; ``served_by`` says which implementation serves each.

    Calling a comm op through the communicator checks that the serving part claims it.
    """

    point_to_point: PointToPoint
    collectives: Collectives

    @property
    def served_by(self) -> dict[str, str]:
        return {"point_to_point": self.point_to_point.name, "collectives": self.collectives.name}

    @property
    def served_by_call(self) -> dict[str, str]:
        """Each call -> the name of the implementation serving it (``"unclaimed"`` when none)."""
        out = {}
        for part, calls in ((self.point_to_point, P2P_CALLS), (self.collectives, COLLECTIVE_CALLS)):
            for call in sorted(calls):
                out[call] = part.name if call in part.capabilities else "unclaimed"
        return out

    def _part(self, call: str) -> Any:
        part: Any = self.point_to_point if call in P2P_CALLS else self.collectives
        if call not in part.capabilities:
            raise CommCapabilityError(
                f"rank {_rank()}: {call} is not served by {part.name!r} (it claims {sorted(part.capabilities)}); "
                f"install a plugin whose comm part claims {call!r} or avoid the call"
            )
        return part

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._part("send").send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._part("recv").recv(tensor, src)

    def batch_isend_irecv(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        self._part("batch_isend_irecv").batch_isend_irecv(sends, recvs)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if "all_reduce" in self.collectives.capabilities:  # the hot path: no extra call
            return self.collectives.all_reduce(tensor)
        return self._part("all_reduce").all_reduce(tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._part("all_gather").all_gather(tensor, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._part("reduce_scatter").reduce_scatter(tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._part("broadcast").broadcast(tensor, src)

    def barrier(self) -> None:
        self._part("barrier").barrier()


# -- helpers of the torch.distributed defaults ---------------------------------------------------


def _rank() -> int | str:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else "?"


def _require_group(call: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise CommInitError(
            f"{call}: torch.distributed has no default process group; call vllm_port.comm.init_from_env first"
        )
    return dist.get_rank(), dist.get_world_size()


def _check_tensor(call: str, rank: int, tensor: Any, what: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise CommInputError(f"rank {rank}: {call}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.is_meta:
        raise CommInputError(f"rank {rank}: {call}: {what} must be a dense tensor on a device, got {tensor.layout}")
    if tensor.dtype not in _DTYPE_CODE:
        raise CommInputError(
            f"rank {rank}: {call}: dtype {tensor.dtype} is not supported; use one of "
            f"{[str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES]}"
        )


def _check_peer(call: str, rank: int, world: int, peer: Any, what: str) -> None:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < world:
        raise CommInputError(f"rank {rank}: {call}: {what}={peer!r} is not a rank of the group (0..{world - 1})")
    if what in ("dst", "src") and call in P2P_CALLS and peer == rank:
        raise CommInputError(f"rank {rank}: {call}: {what}={peer} is this rank; point-to-point needs another rank")


def _check_dim(call: str, rank: int, tensor: torch.Tensor, dim: Any) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise CommInputError(f"rank {rank}: {call}: dim={dim!r} is out of range for a {tensor.dim()}-d tensor")
    if tensor.dim() == 0:
        raise CommInputError(f"rank {rank}: {call}: needs a tensor with at least one dim, got a scalar")
    return dim % tensor.dim()


def _translate(e: BaseException, call: str, rank: int, peer: str = "") -> CommError:
    """A backend failure (timeout, dead peer) as a CommError naming the rank and the call."""
    text = str(e)
    where = f"rank {rank}: {call}{peer}"
    if "timeout" in text.lower() or "timed out" in text.lower():
        return CommTimeoutError(f"{where}: a peer did not join within the process-group timeout: {text}")
    if any(s in text for s in ("Connection reset", "Connection closed", "Broken pipe", "peer")):
        return CommTimeoutError(f"{where}: a peer died or left during the call: {text}")
    return CommError(f"{where} failed: {text}")


@contextlib.contextmanager
def _guard(call: str, rank: int, peer: str = "") -> Iterator[None]:
    """Turn a backend failure (timeout, dead peer) into a CommError naming the rank and the call."""
    try:
        yield
    except CommError:
        raise
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        raise _translate(e, call, rank, peer) from e


def _exchange_meta(call: str, rank: int, world: int, tensor: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Every rank's (dtype, shape), through one small all_gather of int64 on the tensor's device."""
    if tensor.dim() > _MAX_DIMS:
        raise CommInputError(f"rank {rank}: {call}: at most {_MAX_DIMS} dims are supported, got {tensor.dim()}")
    meta = torch.full((2 + _MAX_DIMS,), -1, dtype=torch.int64)
    meta[0], meta[1] = tensor.dim(), _DTYPE_CODE[tensor.dtype]
    meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    meta = meta.to(tensor.device)
    parts = [torch.empty_like(meta) for _ in range(world)]
    with _guard(call + " (shape exchange)", rank):
        dist.all_gather(parts, meta)
    out = []
    for p in parts:
        row = p.tolist()
        out.append((SUPPORTED_DTYPES[row[1]], tuple(row[2 : 2 + row[0]])))
    return out


def _describe(metas: list[tuple[torch.dtype, tuple[int, ...]]]) -> str:
    return ", ".join(f"rank {r}: {str(d).removeprefix('torch.')}{list(s)}" for r, (d, s) in enumerate(metas))


class TorchPointToPoint(PointToPoint):
    """Point-to-point on ``torch.distributed``'s default process group."""

    name = "torch.distributed"

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        rank, world = _require_group("send")
        _check_tensor("send", rank, tensor)
        _check_peer("send", rank, world, dst, "dst")
        with _guard("send", rank, f" to rank {dst}"):
            dist.send(tensor.contiguous(), dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        rank, world = _require_group("recv")
        _check_tensor("recv", rank, tensor)
        _check_peer("recv", rank, world, src, "src")
        buf = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        with _guard("recv", rank, f" from rank {src}"):
            dist.recv(buf, src)
        if buf is not tensor:
            tensor.copy_(buf)

    def batch_isend_irecv(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        call = "batch_isend_irecv"
        rank, world = _require_group(call)
        ops, copy_back = [], []
        for i, (t, peer) in enumerate(sends):
            _check_tensor(call, rank, t, f"sends[{i}]")
            _check_peer(call, rank, world, peer, "dst")
            ops.append(dist.P2POp(dist.isend, t.contiguous(), peer))
        for i, (t, peer) in enumerate(recvs):
            _check_tensor(call, rank, t, f"recvs[{i}]")
            _check_peer(call, rank, world, peer, "src")
            buf = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
            if buf is not t:
                copy_back.append((t, buf))
            ops.append(dist.P2POp(dist.irecv, buf, peer))
        if not ops:
            return
        peers = sorted({p for _, p in sends} | {p for _, p in recvs})
        with _guard(call, rank, f" with ranks {peers}"):
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for t, buf in copy_back:
            t.copy_(buf)


class TorchCollectives(Collectives):
    """Collectives on ``torch.distributed``'s default process group."""

    name = "torch.distributed"
    #: exchange shapes before all_gather/reduce_scatter to catch mismatches (one small extra collective)
    check_shapes: bool = True

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # the hot path: cheap checks inline, the group and the rank looked up only to report an error
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPE_CODE or tensor.layout != torch.strided:
            _check_tensor("all_reduce", _require_group("all_reduce")[0], tensor)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        try:
            dist.all_reduce(buf)
        except (RuntimeError, ValueError) as e:
            _require_group("all_reduce")
            raise _translate(e, "all_reduce", dist.get_rank()) from e
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        rank, world = _require_group("all_gather")
        _check_tensor("all_gather", rank, tensor)
        dim = _check_dim("all_gather", rank, tensor, dim)
        metas = _exchange_meta("all_gather", rank, world, tensor)
        dtypes = {d for d, _ in metas}
        shapes = [s for _, s in metas]
        strip = [s[:dim] + s[dim + 1 :] for s in shapes]
        if len(dtypes) != 1 or any(len(s) != tensor.dim() for s in shapes) or len(set(strip)) != 1:
            raise CommShapeMismatchError(
                f"rank {rank}: all_gather(dim={dim}): ranks must pass the same dtype and the same size in every dim "
                f"but {dim}; got {_describe(metas)}"
            )
        sizes = [s[dim] for s in shapes]
        biggest = max(sizes)
        src = tensor.movedim(dim, 0)
        if src.shape[0] < biggest:  # uneven: pad to the largest shard for the transfer
            pad = src.new_zeros((biggest - src.shape[0], *src.shape[1:]))
            src = torch.cat([src, pad])
        src = src.contiguous()
        parts = [torch.empty_like(src) for _ in range(world)]
        with _guard("all_gather", rank):
            dist.all_gather(parts, src)
        out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])
        return out.movedim(0, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        call = "reduce_scatter"
        rank, world = _require_group(call)
        _check_tensor(call, rank, tensor)
        dim = _check_dim(call, rank, tensor, dim)
        if self.check_shapes:
            metas = _exchange_meta(call, rank, world, tensor)
            if len(set(metas)) != 1:
                raise CommShapeMismatchError(
                    f"rank {rank}: {call}(dim={dim}): ranks must pass the same dtype and shape; got {_describe(metas)}"
                )
        size = tensor.shape[dim]
        if size % world == 0:
            chunks = [c.contiguous() for c in tensor.movedim(dim, 0).chunk(world)]
            out = torch.empty_like(chunks[rank])
            with _guard(call, rank):
                dist.reduce_scatter(out, chunks)
            return out.movedim(0, dim)
        # uneven split: all_reduce a copy, keep this rank's slice (tensor_split's rule)
        total = tensor.contiguous().clone()
        with _guard(call + " (uneven, via all_reduce)", rank):
            dist.all_reduce(total)
        return torch.tensor_split(total, world, dim=dim)[rank].contiguous()

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        rank, world = _require_group("broadcast")
        _check_tensor("broadcast", rank, tensor)
        _check_peer("broadcast", rank, world, src, "src")
        buf = tensor.contiguous()
        with _guard("broadcast", rank, f" from rank {src}"):
            dist.broadcast(buf, src)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    def barrier(self) -> None:
        rank, _ = _require_group("barrier")
        with _guard("barrier", rank):
            dist.barrier()


# -- process group setup ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in the group :func:`init_from_env` set up."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CommInitError(f"init_from_env: ${name}={value!r} is not an integer") from None


def init_from_env(
    platform: PlatformDescription, timeout_s: float = 300.0, device_count: int | None = None
) -> DistContext:
    """Initialise the default process group from ``torchrun``'s environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (all required) and
    ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (default: ``RANK``/``WORLD_SIZE``, one node). Uses the
    platform's ``dist_backend`` and ``timeout_s`` as the process-group timeout, so a rank that never
    joins a call ends in :class:`~vllm_port.errors.CommTimeoutError` rather than a hang.

    A selected runtime calls this with its platform and its probe's device count:
    :meth:`vllm_port.runtime.Runtime.init_process_group`.

    :param platform: the platform's description (its device type and ``dist_backend``).
    :param device_count: devices on this node (``None``: unknown, not checked).
    :raises CommInitError: ``platform`` is no platform description, the environment is incomplete,
        or more ranks per node than devices (non-CPU platforms).
    """
    if not isinstance(platform, PlatformDescription):
        raise CommInitError(
            f"init_from_env: platform is {type(platform).__name__}, not a PlatformDescription; pass "
            "runtime.platform (and device_count), or call runtime.init_process_group(timeout_s)"
        )
    desc = platform
    missing = [n for n in _ENV if not os.environ.get(n)]
    if missing:
        raise CommInitError(
            f"init_from_env: the environment lacks {', '.join('$' + n for n in missing)}; launch with torchrun "
            f"(or set {', '.join(_ENV)})"
        )
    rank = _env_int("RANK", os.environ["RANK"])
    world = _env_int("WORLD_SIZE", os.environ["WORLD_SIZE"])
    local_rank = _env_int("LOCAL_RANK", os.environ.get("LOCAL_RANK", str(rank)))
    local_world = _env_int("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if not (world >= 1 and 0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise CommInitError(
            f"init_from_env: inconsistent environment RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local_rank} "
            f"LOCAL_WORLD_SIZE={local_world}"
        )
    if timeout_s <= 0:
        raise CommInitError(f"init_from_env: timeout_s must be positive, got {timeout_s}")
    if desc.device_type == "cpu":
        device = torch.device("cpu")
    else:
        if device_count is not None and local_world > device_count:
            raise CommInitError(
                f"init_from_env: {local_world} ranks per node but platform {desc.name!r} has {device_count} "
                f"{desc.device_type} device(s) here; launch at most {device_count} ranks per node"
            )
        device = torch.device(desc.device_type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                backend=desc.dist_backend,
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        except (RuntimeError, ValueError) as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise CommTimeoutError(
                    f"rank {rank}: init_process_group: not every one of the {world} ranks joined within "
                    f"{timeout_s} s at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {e}"
                ) from e
            raise CommInitError(
                f"init_from_env: rank {rank}: could not set up the {desc.dist_backend} process group of {world} "
                f"ranks at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {e}"
            ) from e
    return DistContext(rank, world, local_rank, local_world, desc.dist_backend, device)
