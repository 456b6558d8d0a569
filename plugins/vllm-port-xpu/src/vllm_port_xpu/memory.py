"""Device-memory allocator for the XPU platform, on torch's XPU caching allocator."""

from __future__ import annotations

import torch

from vllm_port.plugin_kit import DeviceAllocator


class XpuAllocator(DeviceAllocator):
    """Flat byte buffers in Intel GPU memory; free and total come from Level Zero and torch's cache."""

    def __init__(self, device: torch.device | str = "xpu") -> None:
        super().__init__("xpu allocator", device, torch_device="xpu")
