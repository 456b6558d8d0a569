"""Memory for the CUDA platform: the device allocator on torch's CUDA caching allocator, and the migrator."""

from __future__ import annotations

import torch

from vllm_port.kernels.swap_migrator import FusedSwapMigrator
from vllm_port.plugin_kit import DeviceAllocator


class CudaAllocator(DeviceAllocator):
    """Flat byte buffers in GPU memory; free and total come from the CUDA driver and torch's cache."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__("cuda allocator", device, torch_device="cuda")


def cuda_migrator() -> FusedSwapMigrator:
    """Core's migrator with the one-launch swap kernel: CUDA maps pinned host memory into every device
    (unified virtual addressing), so a small swap is one Triton kernel writing or reading the host
    cache directly; swaps of 64 MiB or more keep the chunked copies, which reach the link there."""
    return FusedSwapMigrator(kernel_below_bytes=64 << 20)
