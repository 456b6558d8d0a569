"""The memory contract: an allocator per platform, a KV-cache block pool, a migrator between tiers.

The base :class:`Allocator` does the checking and the accounting in its public methods; a vendor
fills in the primitives ``_alloc``, ``_free`` and ``_mem_info`` (the tinygrad shape). Buffers are
flat ``torch.uint8`` tensors on the platform's device, so any op can view them with another dtype.
:class:`TorchMigrator` is core's migrator; the one that swaps in a single Triton launch,
``FusedSwapMigrator``, stands beside its kernel (:mod:`vllm_port.kernels.swap_migrator`).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .errors import MemoryContractError
from .kv_pool import BlockPool, blocks_for_budget, kv_block_bytes

__all__ = [
    "Allocator",
    "BlockPoolFactory",
    "HostMemoryAllocator",
    "KVCache",
    "KVLayout",
    "MemoryContractError",
    "MemoryStats",
    "MigrationHandle",
    "Migrator",
    "OutOfMemoryError",
    "TorchDeviceAllocator",
    "TorchMigrator",
    "consecutive_runs",
    "copy_across_tiers",
    "default_allocator",
    "default_block_pool_factory",
    "host_memory",
]


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
        """Return a new uninitialised buffer of ``nbytes`` bytes; raise ``OutOfMemoryError`` when it does not fit.

        :raises MemoryContractError: for a size that is not a positive int, or when ``_alloc`` answers
            something other than a fresh flat ``uint8`` buffer of ``nbytes`` on this allocator's device.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise MemoryContractError(f"{self.name}: allocate needs a positive int of bytes, got {nbytes!r}")
        free, _ = self._mem_info()
        if nbytes > free:
            raise OutOfMemoryError(self.name, nbytes, free)
        try:
            buffer = self._alloc(nbytes)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemoryError(self.name, nbytes, self._mem_info()[0]) from exc
        problem = self._misfit(buffer, nbytes)
        if problem:
            raise MemoryContractError(
                f"{self.name}: _alloc({nbytes:,}) {problem}; it must return a new contiguous 1-d uint8 tensor of "
                f"exactly the bytes asked for, on {self.device.type}, sharing no memory with a live buffer"
            )
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

    def _misfit(self, buffer: Any, nbytes: int) -> str:
        """What is wrong with ``_alloc``'s answer for ``nbytes`` (empty when nothing is)."""
        if not isinstance(buffer, torch.Tensor):
            return f"returned {type(buffer).__name__}, not a tensor"
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            return f"returned a {buffer.dim()}-d {buffer.dtype} tensor (contiguous: {buffer.is_contiguous()})"
        if buffer.numel() != nbytes:
            return f"returned {buffer.numel():,} bytes"
        if buffer.device.type != self.device.type:
            return f"returned a buffer on {buffer.device}"
        if buffer.data_ptr() in self._live:
            return f"returned memory at {buffer.data_ptr():#x}, where a live buffer of this allocator starts"
        return ""

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


class HostMemoryAllocator(Allocator):
    """Host memory for the ``pinned_host`` tier (page-locked, so device copies run asynchronously)
    and the ``host`` tier (pageable). Free and total come from ``/proc/meminfo`` where it exists."""

    def __init__(
        self, pinned: bool, meminfo: str = "/proc/meminfo", name: str | None = None, zoneinfo: str | None = None
    ) -> None:
        super().__init__(name or ("pinned host allocator" if pinned else "host allocator"), "cpu")
        self.pinned = pinned
        self._meminfo = meminfo
        # a recorded meminfo (tests, another machine's files) is read alone, never mixed with this machine's zones
        self._zoneinfo = zoneinfo if zoneinfo is not None or meminfo != "/proc/meminfo" else "/proc/zoneinfo"

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    def _mem_info(self) -> tuple[int, int]:
        return host_memory(self._meminfo, self._zoneinfo)

    def _empty_cache(self) -> None:
        # torch keeps freed page-locked blocks in its host cache; only this gives them back to the OS
        if self.pinned and torch.accelerator.is_available():
            _empty_host_cache()


def _empty_host_cache() -> None:
    """Give torch's cached page-locked blocks back to the OS.

    torch 2.13 names this ``torch.accelerator.empty_host_cache``; from 2.5 to 2.12 it exists only as
    the private ``torch._C._host_emptyCache`` (the GPU machine has torch 2.11).
    """
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


class TorchDeviceAllocator(Allocator):
    """Core's device allocator for a platform that brings none: torch's caching allocator of the
    current accelerator (``torch.accelerator``), free and total from its driver.

    Memory torch has cached but not handed out counts as free, since a new buffer reuses it first;
    ``empty_cache`` gives it back to the driver.
    """

    def __init__(self, device: torch.device | str, name: str | None = None) -> None:
        device = torch.device(device)
        super().__init__(name or f"{device.type} allocator (core's default)", device)
        self._index = device.index if device.index is not None else 0

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _mem_info(self) -> tuple[int, int]:
        free, total = torch.accelerator.get_memory_info(self._index)
        cached = torch.accelerator.memory_reserved(self._index) - torch.accelerator.memory_allocated(self._index)
        return free + cached, total

    def _empty_cache(self) -> None:
        torch.accelerator.empty_cache()


def default_allocator(device_type: str) -> Allocator | None:
    """Core's allocator for the device tier of a platform whose plugins bring none.

    Host memory for ``cpu``; torch's caching allocator for the current accelerator's device type;
    ``None`` for any other device type (its plugin must provide one).
    """
    if device_type == "cpu":
        return HostMemoryAllocator(pinned=False, name="host allocator (core's default)")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is not None and accelerator.type == device_type:
        return TorchDeviceAllocator(torch.device(device_type, 0))
    return None


def host_memory(meminfo: str = "/proc/meminfo", zoneinfo: str | None = "/proc/zoneinfo") -> tuple[int, int]:
    """``(available, total)`` bytes of host memory, or ``sysconf``'s counts without /proc.

    Available is MemAvailable plus the free pages parked on the kernel's per-CPU lists (``count``
    of each pageset in /proc/zoneinfo), which MemAvailable leaves out: since Linux 6.7 those lists
    grow to hundreds of MiB per CPU, so a freed buffer of that size would not show as free at all.
    ``zoneinfo=None`` reads MemAvailable alone.
    """
    try:
        with open(meminfo, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available, total = int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    per_cpu = _per_cpu_free_pages(zoneinfo) if zoneinfo is not None else 0
    return min(total, available + per_cpu * os.sysconf("SC_PAGE_SIZE")), total


def _per_cpu_free_pages(zoneinfo: str) -> int:
    """Free pages on the per-CPU lists of every zone (the ``count:`` lines of /proc/zoneinfo's pagesets)."""
    try:
        with open(zoneinfo, encoding="ascii") as f:
            return sum(int(line.split(":", 1)[1]) for line in f if line.strip().startswith("count:"))
    except (OSError, ValueError):
        return 0


class Migrator(Protocol):
    """Moves KV blocks between a platform's memory tiers (swap out, swap in, offload)."""

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> Any:
        """Copy blocks ``pairs[:, 0]`` of ``src`` into blocks ``pairs[:, 1]`` of ``dst``; return a waitable handle.

        ``src`` and ``dst`` index blocks along dim 0 and agree on the rest of the shape and the
        dtype; a block may be a strided view (``KVCache.blocks``: one block of every layer).
        """
        ...


#: Builds a block pool from a byte budget, the bytes one block takes and the tokens per block:
#: ``factory(budget_bytes, block_bytes, block_size)``.
BlockPoolFactory = Callable[[int, int, int], Any]


def default_block_pool_factory(budget_bytes: int, block_bytes: int, block_size: int) -> BlockPool:
    """Core's device-free pool: as many blocks of ``block_bytes`` as fit in ``budget_bytes``."""
    num_blocks = blocks_for_budget(budget_bytes, block_bytes)
    if num_blocks == 0:
        raise MemoryContractError(
            f"a KV-cache budget of {budget_bytes:,} bytes holds no block of {block_bytes:,} bytes; raise the budget"
        )
    return BlockPool(num_blocks, block_size)


# -------------------------------------------------------------------------------------------------
# The KV cache: per-layer key/value tensors in one allocator buffer, and the pool of their blocks
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayout:
    """The paged cache's shape: per layer, keys and values of ``[num_blocks, block_size, num_kv_heads, head_size]``."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, keys and values."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_size, self.block_size, itemsize)


class KVCache:
    """Per-layer key and value caches carved from one buffer of ``allocator``, and their block pool.

    :param budget: a float in ``(0, 1]`` is that fraction of the device's free memory
        (``allocator.mem_info()``); an int is bytes. Whole blocks fill it (every block but a
        partial last one, so at least 95% of any budget of 20 blocks or more).
    :param pool_factory: builds the pool (``Runtime.block_pool_factory()``); core's default when ``None``.
    :param block_major: store each block's layers side by side (``[num_blocks, 2, num_layers, ...]``)
        instead of each layer's blocks (``[2, num_layers, num_blocks, ...]``, what attention kernels
        read). A swap tier wants it: every block is then one contiguous run that moves in one copy.
    :param head_major: store each block's rows of one KV head side by side (a layer's keys
        ``[num_blocks, num_kv_heads, block_size, head_size]`` in memory), seen through the contract's
        ``[num_blocks, block_size, num_kv_heads, head_size]``: a platform's ``kv_head_major``.
    :raises MemoryContractError: for a budget larger than the device or holding no block.
    :raises OutOfMemoryError: when the device's free memory cannot hold the budget's blocks.
    """

    def __init__(
        self,
        allocator: Allocator,
        layout: KVLayout,
        budget: float | int,
        pool_factory: BlockPoolFactory | None = None,
        block_major: bool = False,
        head_major: bool = False,
    ) -> None:
        if block_major and head_major:
            raise MemoryContractError("a KV cache is block-major (a swap tier) or head-major (a device's), not both")
        free, total = allocator.mem_info()
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise MemoryContractError(
                f"KV-cache budget must be a fraction in (0, 1] or an int of bytes, got {budget!r}"
            )
        if isinstance(budget, float):
            if not 0.0 < budget <= 1.0:
                raise MemoryContractError(f"KV-cache budget fraction must be in (0, 1], got {budget!r}")
            budget_bytes = int(free * budget)
        else:
            budget_bytes = budget
        if budget_bytes <= 0:
            raise MemoryContractError(f"KV-cache budget must be positive, got {budget_bytes:,} bytes")
        if budget_bytes > total:
            raise MemoryContractError(
                f"{allocator.name}: a KV-cache budget of {budget_bytes:,} bytes is larger than the device's "
                f"{total:,} bytes; lower the budget"
            )
        block_bytes = layout.block_bytes
        self.pool = (pool_factory or default_block_pool_factory)(budget_bytes, block_bytes, layout.block_size)
        self.allocator = allocator
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.num_blocks: int = self.pool.num_blocks
        self.buffer = allocator.allocate(self.num_blocks * block_bytes)
        self.block_major, self.head_major = block_major, head_major
        block = (layout.block_size, layout.num_kv_heads, layout.head_size)
        elements = self.buffer.view(layout.dtype)
        if block_major:
            blocks = elements.view(self.num_blocks, 2, layout.num_layers, *block)
            caches = blocks.permute(1, 2, 0, 3, 4, 5)
        elif head_major:  # stored with the head before the token; seen token before head, as the contract says
            stored = elements.view(2, layout.num_layers, self.num_blocks, layout.num_kv_heads, *block[::2])
            caches = stored.permute(0, 1, 2, 4, 3, 5)
            blocks = caches.permute(2, 0, 1, 3, 4, 5)
        else:
            caches = elements.view(2, layout.num_layers, self.num_blocks, *block)
            blocks = caches.permute(2, 0, 1, 3, 4, 5)
        #: ``blocks[b]`` is block ``b`` of every layer's keys and values,
        #: ``[num_blocks, 2, num_layers, block_size, num_kv_heads, head_size]``: what the migrator moves.
        self.blocks: torch.Tensor = blocks
        self.key_caches: list[torch.Tensor] = list(caches[0].unbind(0))
        self.value_caches: list[torch.Tensor] = list(caches[1].unbind(0))

    @property
    def capacity_fraction(self) -> float:
        """The fraction of the budget that became blocks."""
        return self.num_blocks * self.layout.block_bytes / self.budget_bytes

    def close(self) -> None:
        """Give the buffer back to the allocator; the caches must not be used after."""
        if self.buffer is not None:
            self.key_caches, self.value_caches = [], []
            self.blocks = self.blocks.new_empty((0, *self.blocks.shape[1:]))
            buffer, self.buffer = self.buffer, None
            self.allocator.free(buffer)


# -------------------------------------------------------------------------------------------------
# Migration between tiers
# -------------------------------------------------------------------------------------------------


#: A block of one cache: ((device, address of the cache's first element), block id).
_BlockKey = tuple[tuple[str, int], int]


class MigrationHandle:
    """One ``copy_blocks`` in flight: ``done()`` polls, ``wait()`` blocks until the copy is complete.

    Until the handle reports completion its blocks stay in flight: the migrator refuses new copies
    that write them or into them, and pools passed to ``copy_blocks`` refuse to free them.
    """

    def __init__(
        self,
        migrator: TorchMigrator,
        reads: list[_BlockKey],
        writes: list[_BlockKey],
        holds: list[tuple[Any, list[int]]],
        event: Any,
    ) -> None:
        self._migrator = migrator
        self._reads, self._writes = reads, writes
        self._holds = holds
        self._event = event
        self._finished = False

    def done(self) -> bool:
        """Whether the copy is complete (and, if so, its blocks are released)."""
        if not self._finished and (self._event is None or self._event.query()):
            self._finish()
        return self._finished

    def wait(self) -> None:
        """Block until the copy is complete, then release its blocks."""
        if not self._finished:
            if self._event is not None:
                self._event.synchronize()
            self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._migrator._release(self._reads, self._writes)
        for pool, blocks in self._holds:
            pool.release(blocks)


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()


class TorchMigrator:
    """Core's default migrator: indexed block copies with plain torch, on a side stream where the
    platform has streams (``torch.Stream``/``torch.Event``), synchronously on CPU.

    Across tiers it stages on the device (see :func:`copy_across_tiers`), so the copy engines see
    one transfer per run of consecutive host blocks instead of one per block, and the staging of
    one chunk overlaps the transfer of the last.
    """

    def __init__(self, chunk_bytes: int = 16 << 20) -> None:
        """:param chunk_bytes: bytes a cross-tier copy stages at a time (three chunks in flight)."""
        if chunk_bytes <= 0:
            raise MemoryContractError(f"TorchMigrator: chunk_bytes must be positive, got {chunk_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self._reading: dict[_BlockKey, int] = {}  # (cache address, block) -> copies reading it
        self._writing: set[_BlockKey] = set()  # (cache address, block) being written
        self._streams: dict[torch.device, tuple[Any, Any]] = {}

    def in_flight(self, cache: torch.Tensor, block: int) -> bool:
        """Whether ``block`` of ``cache`` belongs to a copy whose handle has not reported completion."""
        key = (_storage_key(cache), block)
        return key in self._writing or key in self._reading

    def copy_blocks(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        pairs: torch.Tensor | list[tuple[int, int]],
        *,
        src_pool: Any = None,
        dst_pool: Any = None,
    ) -> MigrationHandle:
        """Copy block ``pairs[i][0]`` of ``src`` into block ``pairs[i][1]`` of ``dst`` for every ``i``.

        :param src_pool, dst_pool: block pools whose blocks these are; they refuse to free them
            until the handle reports completion.
        :raises MemoryContractError: for mismatched caches, block ids out of range, a destination
            named twice, or a block already in flight (written by, or being read while written by,
            another copy).
        """
        if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
            raise MemoryContractError(
                f"copy_blocks: caches differ: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}"
            )
        try:
            pair_list = [(int(a), int(b)) for a, b in (pairs.tolist() if isinstance(pairs, torch.Tensor) else pairs)]
        except (TypeError, ValueError) as exc:
            raise MemoryContractError(f"copy_blocks: pairs must be (src block, dst block) pairs: {exc}") from exc
        src_ids = [a for a, _ in pair_list]
        dst_ids = [b for _, b in pair_list]
        for name, ids, n in (("src", src_ids, src.shape[0]), ("dst", dst_ids, dst.shape[0])):
            bad = [i for i in ids if not 0 <= i < n]
            if bad:
                raise MemoryContractError(f"copy_blocks: {name} block(s) {bad} out of range for {n} blocks")
        if len(set(dst_ids)) != len(dst_ids):
            raise MemoryContractError(f"copy_blocks: a destination block is named twice in {dst_ids}")
        skey, dkey = _storage_key(src), _storage_key(dst)
        busy = [("src", b) for b in src_ids if (skey, b) in self._writing]
        busy += [("dst", b) for b in dst_ids if (dkey, b) in self._writing or (dkey, b) in self._reading]
        if busy:
            raise MemoryContractError(
                f"copy_blocks: block(s) {busy} are in flight in an earlier copy; wait() on its handle first"
            )
        holds = [(p, ids) for p, ids in ((src_pool, src_ids), (dst_pool, dst_ids)) if p is not None and ids]
        for i, (pool, ids) in enumerate(holds):  # a pool refusing (e.g. a free block) undoes earlier holds
            try:
                pool.hold(ids)
            except Exception:
                for p, held in holds[:i]:
                    p.release(held)
                raise
        reads, writes = [(skey, b) for b in src_ids], [(dkey, b) for b in dst_ids]
        for key in reads:
            self._reading[key] = self._reading.get(key, 0) + 1
        self._writing.update(writes)
        try:
            event = self._launch(src, dst, src_ids, dst_ids) if pair_list else None
        except BaseException:  # nothing was queued: the blocks are not in flight, nor held
            self._release(reads, writes)
            for pool, ids in holds:
                pool.release(ids)
            raise
        return MigrationHandle(self, reads, writes, holds, event)

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> Any:
        if src.dtype.is_floating_point and src.element_size() == 1:  # float8 (an FP8 KV cache): torch's index
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)  # copies have no kernel for it; bytes are bytes
        device = dst.device if dst.device.type != "cpu" else src.device
        if device.type == "cpu":
            dst.index_copy_(0, torch.tensor(dst_ids), src.index_select(0, torch.tensor(src_ids)))
            return None
        if device not in self._streams:  # the link's stream, and one for work on the device beside it
            self._streams[device] = (torch.Stream(device=device), torch.Stream(device=device))
        link, local = self._streams[device]
        ready = _record(torch.accelerator.current_stream(device))
        _wait(link, ready)  # the copy sees every write queued before it
        _wait(local, ready)
        if src.device == dst.device:
            with _on(link):  # index tensors made on the stream that uses them, freed in its order
                src_idx = torch.tensor(src_ids).to(device, non_blocking=True)
                dst_idx = torch.tensor(dst_ids).to(device, non_blocking=True)
                dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
        else:
            outbound = dst.device.type == "cpu"
            copy_across_tiers(
                src, dst, src_ids, dst_ids, outbound=outbound, chunk_bytes=self.chunk_bytes, link=link, local=local
            )
        return _record(link)

    def _release(self, reads: list[_BlockKey], writes: list[_BlockKey]) -> None:
        for key in reads:
            self._reading[key] -= 1
            if self._reading[key] == 0:
                del self._reading[key]
        self._writing.difference_update(writes)


def consecutive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first id, length)`` of each maximal run of consecutive ids in ``ids``, in order.

    >>> consecutive_runs([4, 5, 6, 9, 2, 3])
    [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    """
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((position, block, 1))
    return runs


def copy_across_tiers(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_ids: list[int],
    dst_ids: list[int],
    *,
    outbound: bool,
    chunk_bytes: int,
    link: Any = None,
    local: Any = None,
    slots: int = 3,
) -> None:
    """Copy blocks between a device tensor and a host tensor through contiguous device buffers.

    Outbound (``src`` on the device, swap-out) gathers the blocks on the device in the order of
    their host ids, then copies each run of consecutive host blocks in one transfer; inbound
    (``dst`` on the device, swap-in) does the reverse and scatters on the device. However
    scattered the device blocks are, the link moves whole runs. The work goes in chunks of at
    most ``chunk_bytes`` through ``slots`` staging buffers: with streams, the gather or scatter
    of one chunk (on ``local``) overlaps the transfer of another (on ``link``), and on return
    ``link`` is ordered after everything queued. Without streams (CPU) it runs in order.
    """
    src_words, dst_words = _as_words(src), _as_words(dst)
    if src_words is not None and dst_words is not None:  # 8-byte elements: 4x fewer for the gather to index
        src, dst = src_words, dst_words
    device = src.device if outbound else dst.device
    host_ids, device_ids = (dst_ids, src_ids) if outbound else (src_ids, dst_ids)
    order = sorted(range(len(host_ids)), key=host_ids.__getitem__)
    host_sorted = [host_ids[i] for i in order]
    per_chunk = max(1, chunk_bytes // max(1, src[0].numel() * src.element_size()))
    slot_blocks = min(per_chunk, len(order))
    slots = min(slots, -(-len(order) // slot_blocks))
    index = torch.tensor([device_ids[i] for i in order])
    with _on(local):
        device_index = (index.pin_memory() if link is not None else index).to(device, non_blocking=True)
        staging = torch.empty((slots * slot_blocks, *src.shape[1:]), dtype=src.dtype, device=device)
    chunks = range(0, len(order), slot_blocks)
    reusable: list[Any] = [None] * slots  # per slot: the event after which its last chunk is done with it
    for chunk, start in enumerate(chunks):
        stop = min(start + slot_blocks, len(order))
        slot, reused = chunk % slots, chunk + slots < len(chunks)
        buffer = staging[slot * slot_blocks : slot * slot_blocks + stop - start]
        runs = consecutive_runs(host_sorted[start:stop])
        if outbound:
            with _on(local):
                _wait(local, reusable[slot])
                torch.index_select(src, 0, device_index[start:stop], out=buffer)
                gathered = _record(local)
            with _on(link):
                _wait(link, gathered)
                for position, first, length in runs:
                    dst[first : first + length].copy_(buffer[position : position + length], non_blocking=True)
                reusable[slot] = _record(link) if reused else None
        else:
            with _on(link):
                _wait(link, reusable[slot])
                for position, first, length in runs:
                    buffer[position : position + length].copy_(src[first : first + length], non_blocking=True)
                landed = _record(link)
            with _on(local):
                _wait(local, landed)
                dst.index_copy_(0, device_index[start:stop], buffer)
                reusable[slot] = _record(local) if reused else None
    if link is not None:
        if not outbound:  # the last scatter ran on the local stream
            _wait(link, _record(local))
        staging.record_stream(link)  # the allocator must not hand it out before the link is done with it


def _as_words(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes as int64 (same layout, last dim shorter), or ``None`` when they do not divide so."""
    if t.dtype == torch.int64 or t.dim() < 2 or t.stride(-1) != 1 or (t.shape[-1] * t.element_size()) % 8:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:  # storage offset or strides not 8-byte aligned
        return None


@contextmanager
def _on(stream: Any) -> Iterator[None]:
    """Make ``stream`` current for the block (nothing when ``None``)."""
    if stream is None:
        yield
        return
    device = torch.accelerator.current_device_index()  # set_stream also makes the stream's device current
    previous = torch.accelerator.current_stream(stream.device)
    torch.accelerator.set_stream(stream)
    try:
        yield
    finally:
        torch.accelerator.set_stream(previous)
        torch.accelerator.set_device_index(device)


def _record(stream: Any) -> Any:
    if stream is None:
        return None
    event = torch.Event(device=stream.device)
    event.record(stream)
    return event


def _wait(stream: Any, event: Any) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)
