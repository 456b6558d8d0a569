"""ROCM providers: the shared Triton kernels, launched with the ROCM target's configuration, and AITER's when installed."""

from __future__ import annotations

import importlib.util

from vllm_port.ops import Provider

from . import aiter_ops

#: Above the reference; AITER's kernels (aiter_ops.AITER_PRIORITY, 30) register higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the ROCM target (imports triton), then AITER's if it imports here.

    Triton is no declared dependency: torch's ROCm wheels bring it (pytorch-triton-rocm, import name ``triton``),
    and declaring ``triton`` would pull NVIDIA's build next to it. Without it (a torch build for another
    device, where this platform is unavailable anyway) the plugin offers no Triton providers.
    """
    if importlib.util.find_spec("triton") is None:
        return aiter_ops.providers()
    from vllm_port.kernels.triton import providers as triton_providers

    from .triton_targets import ROCM

    return triton_providers(ROCM, TRITON_PRIORITY) + aiter_ops.providers()
