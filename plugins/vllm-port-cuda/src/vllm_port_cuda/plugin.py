"""The CUDA plugin's hook implementations: the entry point ``vllm_port: cuda``.

The hooks every platform plugin answers alike come from :func:`vllm_port.plugin_kit.platform_hooks`
(API range, describe, probe, context check, providers, allocator, graph capture); the compilation
hooks below and the migrator are CUDA's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_port import PlatformDescription, hookimpl
from vllm_port.plugin_kit import platform_hooks

from . import ops, platform
from .graph import CudaGraphCapture
from .memory import CudaAllocator, cuda_migrator

if TYPE_CHECKING:
    from vllm_port.flat.passes import GraphPass
    from vllm_port.memory import Migrator

globals().update(
    platform_hooks(
        api_range=">=1.1,<2",  # 1.1: the compilation hooks below
        describe=platform.describe,
        probe=platform.probe,
        torch_device="cuda",
        providers=ops.providers,
        allocator=CudaAllocator,
        graph_capture=CudaGraphCapture,
    )
)


@hookimpl
def vllm_port_graph_passes(platform: PlatformDescription) -> list[GraphPass] | None:
    if platform.name != "cuda":
        return None
    from .fusions import graph_passes  # imports triton: only when flat graphs are built

    return graph_passes()


@hookimpl
def vllm_port_migrator(platform: PlatformDescription) -> Migrator | None:
    return cuda_migrator() if platform.name == "cuda" else None
