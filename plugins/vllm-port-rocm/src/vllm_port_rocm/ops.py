"""ROCM providers: the shared Triton kernels, launched with the ROCM target's configuration, and AITER's when installed."""

from __future__ import annotations

from vllm_port.ops import Provider

from . import aiter_ops

#: Above the reference; AITER's kernels (aiter_ops.AITER_PRIORITY, 30) register higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the ROCM target (imports triton), then AITER's if it imports here."""
    from vllm_port.kernels.triton import ROCM
    from vllm_port.kernels.triton import providers as triton_providers

    return triton_providers(ROCM, TRITON_PRIORITY) + aiter_ops.providers()
