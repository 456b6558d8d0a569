"""The exceptions vllm-port raises. Every message names who (plugin, provider, op), what, and the fix."""

from __future__ import annotations

__all__ = [
    "ApiVersionError",
    "CommCapabilityError",
    "CommError",
    "CommInitError",
    "CommInputError",
    "CommShapeMismatchError",
    "CommTimeoutError",
    "MemoryContractError",
    "ModelLoadError",
    "OpInputError",
    "PluginError",
    "ProviderError",
    "ProviderRejectedError",
    "SelectionError",
    "StrictModeError",
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


class ProviderError(VllmPortError):
    """A bound provider failed at run time: it raised, or returned what its op's contract does not allow.

    The message names the op, the provider, its plugin and the way around it (another provider
    through ``VLLM_PORT_OP_PROVIDERS``, or denying the plugin). ``op``, ``provider`` and ``plugin``
    hold the names.
    """

    def __init__(self, message: str, op: str = "", provider: str = "", plugin: str = "") -> None:
        super().__init__(message)
        self.op, self.provider, self.plugin = op, provider, plugin


class StrictModeError(SelectionError):
    """Strict mode (``VLLM_PORT_STRICT=1``, ``--strict``) refused a fallback: a skipped plugin or provider,
    a reference bound in place of the platform's kernel, a replaced allocator, or an unknown setting."""


class OpInputError(VllmPortError, ValueError):
    """An op was called with arguments outside its contract (dtype, device, shape)."""


class CommError(VllmPortError):
    """A comm call failed; the message names the rank and the call (and the peer, for point-to-point)."""


class CommInputError(CommError, ValueError):
    """A comm call was given input outside the contract (not a tensor, unsupported dtype, bad rank, bad dim)."""


class CommShapeMismatchError(CommInputError):
    """Ranks passed tensors whose shapes or dtypes the call cannot combine; the message lists every rank's."""


class CommTimeoutError(CommError, TimeoutError):
    """A peer did not join a call within the process group's timeout, or died during it."""


class CommCapabilityError(CommError, NotImplementedError):
    """A call that the serving comm part does not claim in its ``capabilities``."""


class CommInitError(CommError):
    """The process group cannot be set up (incomplete torchrun environment, more ranks than devices)."""


class MemoryContractError(VllmPortError):
    """A memory call broke the contract: bad size, double free, a buffer or block this owner did not make."""


class ModelLoadError(VllmPortError, ValueError):
    """A model directory cannot be loaded; the message names the file and the field or tensor, and what was expected.

    Raised for a missing or corrupt file, an unsupported architecture, rope scaling or dtype, and a
    config field or weight that disagrees with what the model needs.
    """
