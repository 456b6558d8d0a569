"""vllm-port plugin for AMD GPUs. The entry point is :mod:`vllm_port_rocm.plugin`."""

from .platform import describe, probe

__all__ = ["describe", "probe"]
