"""The ROCm plugin's hooks: the entry point ``vllm_port: rocm``.

Every hook the plugin answers is written here; what is special to AMD lives in its parts: the KFD
probe (``platform``), the Triton and AITER providers (``ops``). The allocator, the context check and
HIP graphs are core's plugin-kit parts on ``torch.cuda``, under which HIP builds of torch keep their
state (``torch.cuda.CUDAGraph`` is a hipGraph_t there). A hook asked about another platform answers
``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture, device_context_created

from . import ops
from .platform import describe, probe

if TYPE_CHECKING:
    from vllm_port.memory import Allocator
    from vllm_port.ops import Provider

#: the platform these hooks serve (``describe().name``); a hook asked about another answers ``None``
NAME = "rocm"
#: the torch module of HIP builds: they keep HIP's allocator, streams and graphs under torch.cuda
TORCH_DEVICE = "cuda"


@hookimpl
def vllm_port_api_range() -> str:
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe() -> PlatformDescription:
    return describe()


@hookimpl
def vllm_port_platform_probe() -> ProbeResult:
    return probe()


@hookimpl
def vllm_port_platform_context_created() -> bool:
    return device_context_created(TORCH_DEVICE)


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    """Flat byte buffers in GPU memory; free and total come from HIP and torch's cache."""
    return DeviceAllocator("rocm allocator", "cuda", torch_device=TORCH_DEVICE) if platform.name == NAME else None


@hookimpl
def vllm_port_graph_capture(platform: PlatformDescription) -> StreamGraphCapture | None:
    """HIP graphs: warm-up runs on a side stream, as HIP graphs (like CUDA graphs) require, then one captured run."""
    if platform.name != NAME:
        return None
    return StreamGraphCapture("hip graphs", torch_device=TORCH_DEVICE, graph_type="CUDAGraph")
