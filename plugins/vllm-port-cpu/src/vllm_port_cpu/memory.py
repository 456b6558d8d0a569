"""Host-memory allocator for the CPU platform."""

from __future__ import annotations

from vllm_port.memory import HostMemoryAllocator


class HostAllocator(HostMemoryAllocator):
    """The CPU platform's device memory: pageable host memory, free and total from /proc/meminfo."""

    def __init__(self, meminfo_path: str = "/proc/meminfo") -> None:
        super().__init__(pinned=False, meminfo=meminfo_path, name="cpu host allocator")
