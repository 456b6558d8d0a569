"""The CPU plugin's hook implementations: the entry point ``vllm_port: cpu``.

Every hook is one that platform plugins answer alike (:func:`vllm_port.plugin_kit.platform_hooks`);
a CPU has no device context to report, and core's defaults serve comm (gloo) and the block pool.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_port import hookimpl
from vllm_port.faults import SWITCH_VALUES, Setting
from vllm_port.ops import Provider
from vllm_port.plugin_kit import platform_hooks

from . import native, ops, platform
from .memory import HostAllocator


def _providers() -> list[Provider]:
    return ops.PROVIDERS


globals().update(
    platform_hooks(
        api_range=">=1.0,<2",
        describe=platform.describe,
        probe=platform.probe,
        providers=_providers,
        allocator=HostAllocator,
    )
)


@hookimpl
def vllm_port_settings() -> Mapping[str, Setting]:
    """The CPU plugin's own settings: core checks their values, and strict mode any other VLLM_PORT_CPU_* name."""
    return {native.ENV_SWITCH: Setting("0 keeps the native C kernels off, the torch providers serving", SWITCH_VALUES)}
