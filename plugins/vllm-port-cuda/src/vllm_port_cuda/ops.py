"""CUDA providers: the shared Triton kernels, launched with NVIDIA's configuration."""

from __future__ import annotations

from vllm_port.ops import Provider

#: Above the CPU plugin's torch providers (10) and the reference; a vendor library may go higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the CUDA target (imports triton)."""
    from vllm_port.kernels.triton import CUDA
    from vllm_port.kernels.triton import providers as triton_providers

    return triton_providers(CUDA, TRITON_PRIORITY)
