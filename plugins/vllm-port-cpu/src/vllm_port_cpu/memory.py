"""Host-memory allocator for the CPU platform."""

from __future__ import annotations

import torch

from vllm_port.memory import Allocator

from .platform import _meminfo_bytes, _read


class HostAllocator(Allocator):
    """Flat byte buffers in host memory; free and total come from /proc/meminfo."""

    def __init__(self, meminfo_path: str = "/proc/meminfo") -> None:
        super().__init__("cpu host allocator", "cpu")
        self._meminfo_path = meminfo_path

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def _mem_info(self) -> tuple[int, int]:
        meminfo = _read(self._meminfo_path)
        return _meminfo_bytes(meminfo, "MemAvailable"), _meminfo_bytes(meminfo, "MemTotal")
