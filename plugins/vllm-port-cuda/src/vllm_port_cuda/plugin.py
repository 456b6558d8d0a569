"""The CUDA plugin's hook implementations: the entry point ``vllm_port: cuda``."""

from __future__ import annotations

import torch

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Allocator

from . import platform
from .memory import CudaAllocator


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return platform.describe()


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    return platform.probe()


@hookimpl
def vllm_port_platform_context_created() -> bool:
    return torch.cuda.is_initialized()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return CudaAllocator() if platform.name == "cuda" else None
