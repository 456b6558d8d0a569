"""The CPU plugin's hook implementations: the entry point ``vllm_port: cpu``.

Every hook is one that platform plugins answer alike (:func:`vllm_port.plugin_kit.platform_hooks`);
a CPU has no device context to report, and core's defaults serve comm (gloo) and the block pool.
"""

from __future__ import annotations

from vllm_port.ops import Provider
from vllm_port.plugin_kit import platform_hooks

from . import ops, platform
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
