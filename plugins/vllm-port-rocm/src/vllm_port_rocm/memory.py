"""Device-memory allocator for the ROCm platform, on torch's HIP caching allocator (the ``torch.cuda`` API)."""

from __future__ import annotations

import torch

from vllm_port.plugin_kit import DeviceAllocator


class RocmAllocator(DeviceAllocator):
    """Flat byte buffers in GPU memory; free and total come from HIP and torch's cache."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__("rocm allocator", device, torch_device="cuda")  # HIP builds of torch keep it under torch.cuda
