"""XPU providers: the shared Triton kernels, launched with the XPU target's configuration, and IPEX's when it matches torch."""

from __future__ import annotations

from vllm_port.ops import Provider

from . import ipex_ops

#: Above the reference; IPEX's kernels (ipex_ops.IPEX_PRIORITY, 30) register higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the XPU target (imports triton), then IPEX's if it matches torch."""
    from vllm_port.kernels.triton import XPU
    from vllm_port.kernels.triton import providers as triton_providers

    return triton_providers(XPU, TRITON_PRIORITY) + ipex_ops.providers()
