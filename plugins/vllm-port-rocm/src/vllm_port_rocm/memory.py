"""Device-memory allocator for the ROCm platform, on torch's HIP caching allocator (the ``torch.cuda`` API)."""

from __future__ import annotations

import torch

from vllm_port.memory import Allocator


class RocmAllocator(Allocator):
    """Flat byte buffers in GPU memory; free and total come from HIP and torch's cache."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__("rocm allocator", device)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _mem_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        # HIP counts blocks torch's caching allocator holds as used, but a new buffer reuses them first.
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + cached, total

    def _empty_cache(self) -> None:
        torch.cuda.empty_cache()
