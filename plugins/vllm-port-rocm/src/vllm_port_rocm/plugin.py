"""The ROCm plugin's hook implementations: the entry point ``vllm_port: rocm``."""

from __future__ import annotations

import torch

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.graph import GraphCapture
from vllm_port.memory import Allocator
from vllm_port.ops import Provider

from . import ops, platform
from .memory import RocmAllocator


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
    # HIP builds of torch keep their state under torch.cuda.
    return torch.cuda.is_initialized()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return RocmAllocator() if platform.name == "rocm" else None


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()


@hookimpl
def vllm_port_graph_capture(platform: PlatformDescription) -> GraphCapture | None:
    from .graph import HipGraphCapture

    return HipGraphCapture() if platform.name == "rocm" else None
