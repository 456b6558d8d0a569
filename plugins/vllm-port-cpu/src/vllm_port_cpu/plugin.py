"""The CPU plugin's hooks: the entry point ``vllm_port: cpu``.

Every hook the plugin answers is written here: the platform (``platform``: describe and probe), the
providers (``ops``), the device memory (pageable host memory) and the plugin's settings. A CPU has
no device context to report, and core's defaults serve comm (gloo) and the block pool.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_port import PlatformDescription, ProbeResult, hookimpl
from vllm_port.faults import SWITCH_VALUES, Setting
from vllm_port.memory import Allocator, HostMemoryAllocator
from vllm_port.ops import Provider

from . import host_malloc, native, ops
from .platform import describe, probe

#: the platform these hooks serve (``describe().name``); a hook asked about another answers ``None``
NAME = "cpu"


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
def vllm_port_providers() -> list[Provider]:
    return ops.PROVIDERS


@hookimpl
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    return host_allocator() if platform.name == NAME else None


@hookimpl
def vllm_port_settings() -> Mapping[str, Setting]:
    """The CPU plugin's own settings: core checks their values, and strict mode any other VLLM_PORT_CPU_* name."""
    return {
        native.ENV_SWITCH: Setting("0 keeps the native C kernels off, the torch providers serving", SWITCH_VALUES),
        host_malloc.ENV_SWITCH: Setting(
            "0 leaves glibc's malloc thresholds as they are (see host_malloc)", SWITCH_VALUES
        ),
    }


def host_allocator(meminfo_path: str = "/proc/meminfo") -> HostMemoryAllocator:
    """The CPU platform's device memory: pageable host memory, free and total from ``meminfo_path``."""
    return HostMemoryAllocator(pinned=False, meminfo=meminfo_path, name="cpu host allocator")
