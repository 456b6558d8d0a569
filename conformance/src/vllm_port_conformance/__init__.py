"""The shared conformance suite for vllm-port plugins: run ``pytest --pyargs vllm_port_conformance.checks --vllm-port-plugin NAME``."""

CHECKS_PACKAGE = "vllm_port_conformance.checks"

__all__ = ["CHECKS_PACKAGE"]
