"""Device-memory allocator for the XPU platform, on torch's XPU caching allocator."""

from __future__ import annotations

import torch

from vllm_port.memory import Allocator


class XpuAllocator(Allocator):
    """Flat byte buffers in Intel GPU memory; free and total come from Level Zero and torch's cache."""

    def __init__(self, device: torch.device | str = "xpu") -> None:
        super().__init__("xpu allocator", device)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _mem_info(self) -> tuple[int, int]:
        free, total = torch.xpu.mem_get_info(self.device)
        # The driver counts blocks torch's caching allocator holds as used, but a new buffer reuses them first.
        cached = torch.xpu.memory_reserved(self.device) - torch.xpu.memory_allocated(self.device)
        return free + cached, total

    def _empty_cache(self) -> None:
        torch.xpu.empty_cache()
