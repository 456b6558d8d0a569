"""XPU providers: the shared Triton kernels, launched with the XPU target's configuration, and IPEX's when it matches torch."""

from __future__ import annotations

import importlib.util

from vllm_port.ops import Provider

from . import ipex_ops

#: Above the reference; IPEX's kernels (ipex_ops.IPEX_PRIORITY, 30) register higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the XPU target (imports triton), then IPEX's if it matches torch.

    Triton is no declared dependency: torch's XPU wheels bring it (pytorch-triton-xpu, import name ``triton``),
    and declaring ``triton`` would pull NVIDIA's build next to it. Without it (a torch build for another
    device, where this platform is unavailable anyway) the plugin offers no Triton providers.
    """
    if importlib.util.find_spec("triton") is None:
        return ipex_ops.providers()
    from vllm_port.kernels.triton import providers as triton_providers

    from .triton_targets import XPU

    return triton_providers(XPU, TRITON_PRIORITY) + ipex_ops.providers()
