"""vllm-port plugin for Intel GPUs. The entry point is :mod:`vllm_port_xpu.plugin`."""

from .platform import describe, probe

__all__ = ["describe", "probe"]
