"""The CUDA plugin's hook implementations: the entry point ``vllm_port: cuda``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.graph import GraphCapture
from vllm_port.memory import Allocator
from vllm_port.ops import Provider

from . import ops, platform
from .memory import CudaAllocator

if TYPE_CHECKING:
    from vllm_port.flat.passes import GraphPass


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.1,<2"  # 1.1: the compilation hooks below


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


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()


@hookimpl
def vllm_port_graph_capture(platform: PlatformDescription) -> GraphCapture | None:
    from .graph import CudaGraphCapture

    return CudaGraphCapture() if platform.name == "cuda" else None


@hookimpl
def vllm_port_graph_passes(platform: PlatformDescription) -> list[GraphPass] | None:
    if platform.name != "cuda":
        return None
    from .fusions import graph_passes  # imports triton: only when flat graphs are built

    return graph_passes()
