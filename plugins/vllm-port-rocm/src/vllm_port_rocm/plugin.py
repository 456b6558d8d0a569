"""The ROCm plugin's hook implementations: the entry point ``vllm_port: rocm``.

Every hook is one that platform plugins answer alike (:func:`vllm_port.plugin_kit.platform_hooks`);
what is special to AMD lives in the parts: the KFD probe, the AITER providers, the allocator and
HIP graphs, both on ``torch.cuda``, under which HIP builds of torch keep their state.
"""

from __future__ import annotations

from vllm_port.plugin_kit import platform_hooks

from . import ops, platform
from .graph import HipGraphCapture
from .memory import RocmAllocator

globals().update(
    platform_hooks(
        api_range=">=1.0,<2",
        describe=platform.describe,
        probe=platform.probe,
        torch_device="cuda",  # HIP builds of torch keep their state under torch.cuda
        providers=ops.providers,
        allocator=RocmAllocator,
        graph_capture=HipGraphCapture,
    )
)
