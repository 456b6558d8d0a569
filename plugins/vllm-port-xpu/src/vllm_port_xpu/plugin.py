"""The XPU plugin's hook implementations: the entry point ``vllm_port: xpu``.

Every hook is one that platform plugins answer alike (:func:`vllm_port.plugin_kit.platform_hooks`);
what is special to Intel lives in the parts: the probe, the IPEX providers and the allocator on
``torch.xpu``.
"""

from __future__ import annotations

from vllm_port.plugin_kit import platform_hooks

from . import ops, platform
from .memory import XpuAllocator

globals().update(
    platform_hooks(
        api_range=">=1.0,<2",
        describe=platform.describe,
        probe=platform.probe,
        torch_device="xpu",  # torch releases before XPU support have no torch.xpu: no context then
        providers=ops.providers,
        allocator=XpuAllocator,
    )
)
