"""vllm-port plugin for CPUs. The entry point is :mod:`vllm_port_cpu.plugin`."""

from .platform import describe, probe

__all__ = ["describe", "probe"]
