"""vllm-port plugin for NVIDIA GPUs. The entry point is :mod:`vllm_port_cuda.plugin`."""

from .platform import describe, probe

__all__ = ["describe", "probe"]
