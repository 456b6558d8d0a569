"""The migrator that moves a small swap between device and pinned host memory in one Triton launch.

:class:`FusedSwapMigrator` stands beside its kernel (:mod:`vllm_port.kernels.triton.swap`), not in
:mod:`vllm_port.memory`, so the memory contract imports no kernel. It stays outside the
``kernels.triton`` package on purpose: importing that package imports ``triton``, and the
migrator must construct without it (the kernel is imported on the first copy that takes it, and
a platform without Triton falls back to :class:`~vllm_port.memory.TorchMigrator`'s chunked copies).
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from ..errors import MemoryContractError, StrictModeError
from ..faults import fall_back
from ..memory import MigrationHandle, TorchMigrator, _on, _record, _wait

__all__ = ["FusedSwapMigrator"]


class FusedSwapMigrator(TorchMigrator):
    """:class:`TorchMigrator` that moves a small swap between the device and pinned host memory in one kernel.

    A swap of fewer than ``kernel_below_bytes`` between a device cache and a pinned host cache is
    one Triton launch (:func:`vllm_port.kernels.triton.swap.swap_blocks`) on the migrator's link
    stream, ordered after the work queued before the call: the kernel writes the device blocks straight into the host cache through
    its mapping (swap-out), or reads the host blocks from it (swap-in), and reads the block pairs
    from a pinned buffer the same way. The chunked path costs about 25 torch calls of host time a
    call, which is what holds swaps of a few blocks far below the link (docs/results/swap-h200.md).
    Larger swaps, where the link sets the time, take TorchMigrator's chunked copies, as do copies
    within one tier and block layouts the kernel cannot walk. The argument checks, the handles and
    ``in_flight`` are TorchMigrator's.

    A kernel path that fails (Triton missing, a launch that raises) is a fallback: recorded in
    ``fallbacks`` (refused in strict mode, after the copy is made and its blocks are released),
    the copy is made by the chunked path, and so is every later one. ``launches`` counts the copies
    each path made. A platform opts in by answering ``vllm_port_migrator`` with one: the CUDA plugin
    does; any GPU whose Triton maps pinned host memory the same way could.
    """

    def __init__(
        self, chunk_bytes: int = 16 << 20, kernel_below_bytes: int = 64 << 20, *, host_copies: bool = False
    ) -> None:
        """:param chunk_bytes: bytes the chunked path stages at a time (TorchMigrator's).
        :param kernel_below_bytes: swaps of fewer bytes take the kernel; 0 never does.
        :param host_copies: launch the kernel for copies between two host tensors too, which only
            Triton's CPU interpreter runs: how tests reach the kernel path without a GPU.
        """
        super().__init__(chunk_bytes)
        if isinstance(kernel_below_bytes, bool) or not isinstance(kernel_below_bytes, int) or kernel_below_bytes < 0:
            raise MemoryContractError(
                f"FusedSwapMigrator: kernel_below_bytes must be an int >= 0, got {kernel_below_bytes!r}"
            )
        self.kernel_below_bytes = kernel_below_bytes
        self.host_copies = host_copies
        #: copies made by each path: ``"kernel"`` (one launch) and ``"torch"`` (TorchMigrator's)
        self.launches: dict[str, int] = {"kernel": 0, "torch": 0}
        #: why the kernel path was given up, once it was (every later copy takes TorchMigrator's)
        self.fallbacks: list[str] = []
        self._kernel_failed: str | None = None
        self._unreported: str | None = None  # a failure of the copy being made, reported when its handle exists
        self._plans: dict[tuple[Any, ...], Any] = {}  # cache layouts -> BlockCopyPlan, or None for the chunked path
        self._pair_buffers: list[
            list[Any]
        ] = []  # [pinned int64 [rows, 2], a ctypes view of its words, event of its last use]
        self._kernels: Any = None  # .triton.swap, imported (with triton) on the first kernel copy

    def copy_blocks(
        self,
        src: torch.Tensor,
        dst: torch.Tensor,
        pairs: torch.Tensor | list[tuple[int, int]],
        *,
        src_pool: Any = None,
        dst_pool: Any = None,
    ) -> MigrationHandle:
        """As :meth:`TorchMigrator.copy_blocks`; a small cross-tier copy is one kernel launch.

        :raises StrictModeError: in strict mode, when the kernel path failed and the chunked path
            made the copy instead (the copy is complete and its blocks released).
        """
        handle = super().copy_blocks(src, dst, pairs, src_pool=src_pool, dst_pool=dst_pool)
        failure, self._unreported = self._unreported, None
        if failure is not None:
            try:
                fall_back(
                    failure,
                    "make Triton run on this device, with the host cache in pinned memory, or have the platform's "
                    "vllm_port_migrator answer TorchMigrator",
                    record=self.fallbacks,
                )
            except StrictModeError:
                handle.wait()
                raise
        return handle

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> Any:
        try:
            plan = self._kernel_plan(src, dst, len(src_ids))
            event = self._launch_kernel(src, dst, src_ids, dst_ids, plan) if plan is not None else None
        except Exception as exc:  # whatever failed, planning or launching, the chunked path still makes the copy
            self._give_up_kernel(f"the swap kernel raised {type(exc).__name__}: {exc}")
            plan = None
        if plan is not None:
            self.launches["kernel"] += 1
            return event
        self.launches["torch"] += 1
        return super()._launch(src, dst, src_ids, dst_ids)

    def _kernel_plan(self, src: torch.Tensor, dst: torch.Tensor, num_pairs: int) -> Any:
        """The kernel's plan for this copy, or ``None`` when the chunked path should make it."""
        if self._kernel_failed is not None or num_pairs * math.prod(src.shape[1:]) * src.element_size() >= (
            self.kernel_below_bytes
        ):
            return None
        key = (
            src.dtype,
            src.device,
            src.data_ptr(),
            src.shape,
            src.stride(),
            dst.device,
            dst.data_ptr(),
            dst.shape,
            dst.stride(),
        )
        if key not in self._plans:
            if len(self._plans) >= 64:  # caches come and go with runtimes and tests; keep the recent ones
                self._plans.clear()
            self._plans[key] = self._plan(src, dst)
        return self._plans[key]

    def _plan(self, src: torch.Tensor, dst: torch.Tensor) -> Any:
        on_host = [t for t in (src, dst) if t.device.type == "cpu"]
        if len(on_host) == 0 or (len(on_host) == 2 and not self.host_copies):
            return None  # within one tier the copy is one indexed copy already
        if len(on_host) == 1 and not on_host[0].is_pinned():
            return None  # pageable memory is not mapped into the device
        if self._kernels is None:
            try:
                from .triton import swap
            except ImportError as exc:
                self._give_up_kernel(f"the swap kernel cannot be imported ({exc})")
                return None
            self._kernels = swap
        try:
            return self._kernels.plan_block_copy(src, dst)
        except MemoryContractError:  # a block layout the kernel cannot walk
            return None

    def _launch_kernel(
        self, src: torch.Tensor, dst: torch.Tensor, src_ids: list[int], dst_ids: list[int], plan: Any
    ) -> Any:
        swap_blocks = self._kernels.swap_blocks
        device = dst.device if dst.device.type != "cpu" else src.device
        slot = self._pairs_buffer(src_ids, dst_ids, pinned=device.type != "cpu")
        if device.type == "cpu":  # Triton's interpreter: runs to completion here
            swap_blocks(src, dst, slot[0], plan, num_pairs=len(src_ids), check=False)
            return None
        if device not in self._streams:
            self._streams[device] = (torch.Stream(device=device), torch.Stream(device=device))
        link = self._streams[device][0]
        _wait(link, _record(torch.accelerator.current_stream(device)))  # the copy sees every write queued before it
        with _on(link):
            swap_blocks(src, dst, slot[0], plan, num_pairs=len(src_ids), check=False)
        slot[2] = _record(link)  # the pairs buffer is not rewritten before the kernel has read it
        return slot[2]

    def _pairs_buffer(self, src_ids: list[int], dst_ids: list[int], pinned: bool) -> list[Any]:
        """A pairs buffer no kernel still reads, holding ``(src_ids[i], dst_ids[i])`` in its first rows."""
        n = len(src_ids)
        for slot in self._pair_buffers:
            if slot[0].shape[0] >= n and slot[0].is_pinned() == pinned and (slot[2] is None or slot[2].query()):
                break
        else:
            buffer = torch.empty((max(256, 1 << (n - 1).bit_length()), 2), dtype=torch.int64, pin_memory=pinned)
            # the buffer's words, written from Python lists as they are (no numpy: core does not depend on it)
            words = (ctypes.c_int64 * buffer.numel()).from_address(buffer.data_ptr())
            slot = [buffer, words, None]
            self._pair_buffers.append(slot)
        slot[1][0 : 2 * n : 2] = src_ids
        slot[1][1 : 2 * n : 2] = dst_ids
        return slot

    def _give_up_kernel(self, why: str) -> None:
        self._kernel_failed = why
        self._unreported = f"FusedSwapMigrator: {why}; TorchMigrator's chunked copies make this and every later swap"
