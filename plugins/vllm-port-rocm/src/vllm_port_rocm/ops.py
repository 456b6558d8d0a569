"""ROCM providers: the shared Triton kernels, launched with the ROCM target's configuration."""

from __future__ import annotations

from vllm_port.ops import Provider

#: Above the reference; a vendor library's kernels (issue 7) may register higher.
TRITON_PRIORITY = 20


def providers() -> list[Provider]:
    """Every Triton provider with the ROCM target (imports triton)."""
    from vllm_port.kernels.triton import ROCM
    from vllm_port.kernels.triton import providers as triton_providers

    return triton_providers(ROCM, TRITON_PRIORITY)
