"""The CPU plugin's hook implementations: the entry point ``vllm_port: cpu``."""

from __future__ import annotations

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import Allocator
from vllm_port.ops import Provider

from . import ops, platform
from .memory import HostAllocator


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
def vllm_port_providers() -> list[Provider]:
    return ops.PROVIDERS


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return HostAllocator() if platform.name == "cpu" else None
