"""Device-memory allocator for the CUDA platform, on torch's CUDA caching allocator."""

from __future__ import annotations

import torch

from vllm_port.plugin_kit import DeviceAllocator


class CudaAllocator(DeviceAllocator):
    """Flat byte buffers in GPU memory; free and total come from the CUDA driver and torch's cache."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__("cuda allocator", device, torch_device="cuda")
