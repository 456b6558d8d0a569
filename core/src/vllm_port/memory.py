"""The memory contract: an allocator per platform, a KV-cache block pool, a migrator between tiers.

The base :class:`Allocator` does the checking and the accounting in its public methods; a vendor
fills in the primitives ``_alloc``, ``_free`` and ``_mem_info`` (the tinygrad shape). Buffers are
flat ``torch.uint8`` tensors on the platform's device, so any op can view them with another dtype.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import VllmPortError

__all__ = ["Allocator", "BlockPoolFactory", "MemoryContractError", "MemoryStats", "Migrator", "OutOfMemoryError"]


class MemoryContractError(VllmPortError):
    """A memory call broke the contract: bad size, double free, a buffer this allocator did not make."""


class OutOfMemoryError(MemoryContractError):
    """The device cannot hold the allocation; says how much was asked for and how much is free."""

    def __init__(self, allocator: str, requested: int, free: int) -> None:
        super().__init__(
            f"{allocator}: cannot allocate {requested:,} bytes, {free:,} bytes free; "
            "lower the request (e.g. a smaller KV-cache budget) or free buffers first"
        )
        self.requested = requested
        self.free = free


@dataclass(frozen=True)
class MemoryStats:
    """Accounting of one allocator: bytes live now, at their peak, and the number of live buffers."""

    allocated: int
    peak: int
    live_buffers: int


class Allocator(abc.ABC):
    """Allocates flat byte buffers on one device and keeps count of them.

    Subclasses implement ``_alloc(nbytes) -> Tensor``, ``_free(buffer)`` and
    ``_mem_info() -> (free, total)``; they may override ``_empty_cache``.
    """

    def __init__(self, name: str, device: torch.device | str) -> None:
        self.name = name
        self.device = torch.device(device)
        self._live: dict[int, int] = {}  # data_ptr -> nbytes
        self._allocated = 0
        self._peak = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Return a new uninitialised buffer of ``nbytes`` bytes; raise ``OutOfMemoryError`` when it does not fit."""
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise MemoryContractError(f"{self.name}: allocate needs a positive int of bytes, got {nbytes!r}")
        free, _ = self._mem_info()
        if nbytes > free:
            raise OutOfMemoryError(self.name, nbytes, free)
        try:
            buffer = self._alloc(nbytes)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemoryError(self.name, nbytes, self._mem_info()[0]) from exc
        self._live[buffer.data_ptr()] = nbytes
        self._allocated += nbytes
        self._peak = max(self._peak, self._allocated)
        return buffer

    def free(self, buffer: torch.Tensor) -> None:
        """Give back a buffer this allocator returned; a second free or a foreign buffer is an error."""
        nbytes = self._live.pop(buffer.data_ptr(), None) if isinstance(buffer, torch.Tensor) else None
        if nbytes is None:
            raise MemoryContractError(
                f"{self.name}: free of a buffer it does not own (already freed, or allocated elsewhere): {_describe(buffer)}"
            )
        self._allocated -= nbytes
        self._free(buffer)

    def stats(self) -> MemoryStats:
        """Bytes allocated now and at peak, and live buffer count, through this allocator."""
        return MemoryStats(self._allocated, self._peak, len(self._live))

    def mem_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the device, as the platform reports them."""
        return self._mem_info()

    def empty_cache(self) -> None:
        """Return memory cached by the framework's allocator to the device."""
        self._empty_cache()

    @abc.abstractmethod
    def _alloc(self, nbytes: int) -> torch.Tensor: ...

    def _free(self, buffer: torch.Tensor) -> None:
        del buffer

    @abc.abstractmethod
    def _mem_info(self) -> tuple[int, int]: ...

    def _empty_cache(self) -> None:  # noqa: B027 - nothing cached by default
        pass


def _describe(buffer: Any) -> str:
    if isinstance(buffer, torch.Tensor):
        return (
            f"tensor of {buffer.numel() * buffer.element_size():,} bytes at {buffer.data_ptr():#x} on {buffer.device}"
        )
    return repr(buffer)


class Migrator(Protocol):
    """Moves KV blocks between a platform's memory tiers (swap out, swap in, offload)."""

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> Any:
        """Copy blocks ``pairs[:, 0]`` of ``src`` into blocks ``pairs[:, 1]`` of ``dst``; return a waitable handle."""
        ...


#: Builds a block pool from a byte budget and the bytes one block takes.
BlockPoolFactory = Callable[[int, int], Any]
