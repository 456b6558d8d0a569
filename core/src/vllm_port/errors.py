"""The exceptions vllm-port raises. Every message names who (plugin, provider, op), what, and the fix."""

from __future__ import annotations

__all__ = [
    "ApiVersionError",
    "OpInputError",
    "PluginError",
    "ProviderRejectedError",
    "SelectionError",
    "VllmPortError",
]


class VllmPortError(Exception):
    """Base class of every error raised by vllm-port."""


class PluginError(VllmPortError):
    """A plugin could not be loaded, validated or probed; it is skipped and recorded."""


class ApiVersionError(PluginError):
    """A plugin supports a range of the contract API that excludes core's version."""


class SelectionError(VllmPortError):
    """The user's choice of plugins or device cannot be honoured (unknown name, unavailable device)."""


class ProviderRejectedError(VllmPortError):
    """A provider does not honour its op's contract (unknown op, wrong signature, bad metadata)."""


class OpInputError(VllmPortError, ValueError):
    """An op was called with arguments outside its contract (dtype, device, shape)."""
