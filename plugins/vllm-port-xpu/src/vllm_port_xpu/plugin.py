"""The XPU plugin's hooks: the entry point ``vllm_port: xpu``.

Every hook the plugin answers is written here; what is special to Intel lives in its parts: the
probe (``platform``), the Triton and IPEX providers (``ops``). The allocator and the context check
are core's plugin-kit parts on ``torch.xpu``; no graph capture yet. A hook asked about another
platform answers ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.plugin_kit import DeviceAllocator, device_context_created

from . import ops
from .platform import describe, probe

if TYPE_CHECKING:
    from vllm_port.memory import Allocator
    from vllm_port.ops import Provider

#: the platform these hooks serve (``describe().name``); a hook asked about another answers ``None``
NAME = "xpu"


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
    return device_context_created("xpu")  # torch releases before XPU support have no torch.xpu: no context then


@hookimpl
def vllm_port_providers() -> list[Provider]:
    return ops.providers()


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    """Flat byte buffers in Intel GPU memory; free and total come from Level Zero and torch's cache."""
    return DeviceAllocator("xpu allocator", "xpu") if platform.name == NAME else None
