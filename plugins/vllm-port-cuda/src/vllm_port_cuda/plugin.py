"""The CUDA plugin's hooks: the entry point ``vllm_port: cuda``.

Every hook the plugin answers is written here: the platform (``platform``: describe and probe, the
context check on ``torch.cuda``), the providers (``ops``), and the parts core's plugin kit builds on
``torch.cuda`` (the allocator, CUDA graphs); then what is CUDA's own: the one-launch swap migrator
and the compilation hooks (API 1.1). A hook asked about another platform answers ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.kernels.swap_migrator import FusedSwapMigrator
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture, device_context_created

from . import ops
from .platform import describe, probe

if TYPE_CHECKING:
    from vllm_port.graph_pass import GraphPass
    from vllm_port.memory import Allocator, Migrator
    from vllm_port.ops import Provider

#: the platform these hooks serve (``describe().name``); a hook asked about another answers ``None``
NAME = "cuda"
#: swaps below this size are one Triton kernel on mapped host memory; larger ones keep chunked copies
FUSED_SWAP_BELOW_BYTES = 64 << 20


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.1,<2"  # 1.1: the compilation hooks (vllm_port_graph_passes)


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return describe()


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    return probe()


@hookimpl
def vllm_port_platform_context_created() -> bool:
    return device_context_created("cuda")


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    """Flat byte buffers in GPU memory; free and total come from the CUDA driver and torch's cache."""
    return DeviceAllocator("cuda allocator", "cuda") if platform.name == NAME else None


@hookimpl
def vllm_port_graph_capture(platform: PlatformDescription) -> StreamGraphCapture | None:
    """CUDA graphs: warm-up runs on a side stream, as CUDA graphs require, then one captured run."""
    if platform.name != NAME:
        return None
    return StreamGraphCapture("cuda graphs", torch_device="cuda", graph_type="CUDAGraph")


@hookimpl
def vllm_port_migrator(platform: PlatformDescription) -> Migrator | None:
    """Core's migrator with the one-launch swap kernel: CUDA maps pinned host memory into every device
    (unified virtual addressing), so a small swap is one Triton kernel writing or reading the host
    cache directly; swaps of ``FUSED_SWAP_BELOW_BYTES`` or more keep the chunked copies, which reach
    the link there."""
    return FusedSwapMigrator(kernel_below_bytes=FUSED_SWAP_BELOW_BYTES) if platform.name == NAME else None


@hookimpl
def vllm_port_graph_passes(platform: PlatformDescription) -> list[GraphPass] | None:
    if platform.name != NAME:
        return None
    from .fusions import graph_passes  # imports triton: only when flat graphs are built

    return graph_passes()
