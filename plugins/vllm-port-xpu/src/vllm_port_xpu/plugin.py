"""The XPU plugin's hook implementations: the entry point ``vllm_port: xpu``."""

from __future__ import annotations

import torch

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Allocator
from vllm_port.ops import Provider

from . import ops, platform
from .memory import XpuAllocator


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
    # torch releases before XPU support have no torch.xpu at all
    return hasattr(torch, "xpu") and torch.xpu.is_initialized()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return XpuAllocator() if platform.name == "xpu" else None


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()
