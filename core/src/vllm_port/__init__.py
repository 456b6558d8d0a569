"""vllm-port: the portable hardware layer for LLM inference engines.

Core defines the contracts (:mod:`vllm_port.hookspecs`), discovers vendor plugins and selects a
platform; engines run through the bound ops::

    import torch, vllm_port

    runtime = vllm_port.load()                 # discover -> select
    kernels = runtime.bind(torch.bfloat16)     # bind
    y = kernels.rms_norm(x, weight, 1e-6)      # run
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from .api import API_VERSION, ApiRange
from .errors import ApiVersionError, OpInputError, PluginError, ProviderRejectedError, SelectionError, VllmPortError
from .hookspecs import hookimpl
from .platform import DeviceInfo, PlatformDescription, ProbeResult

if TYPE_CHECKING:
    from .runtime import Runtime, load


def __getattr__(name: str) -> object:
    # torch, the runtime and the engine load on first use: `import vllm_port` stays light for plugins,
    # and `vllm-port --help` needs no torch
    if name in ("Runtime", "load"):
        from . import runtime

        return getattr(runtime, name)
    if name in ("LLM", "EngineConfig", "SamplingParams", "Logprob", "TextPrompt", "TokensPrompt"):
        from . import engine

        return getattr(engine, name)
    if name in ("load_many", "Platforms"):  # several platforms at once (vllm_port.placement)
        from .placement import platforms

        return getattr(platforms, name)
    raise AttributeError(f"module 'vllm_port' has no attribute {name!r}")


try:
    __version__ = version("vllm-port")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "API_VERSION",
    "LLM",
    "ApiRange",
    "ApiVersionError",
    "DeviceInfo",
    "EngineConfig",
    "Logprob",
    "OpInputError",
    "PlatformDescription",
    "Platforms",
    "PluginError",
    "ProbeResult",
    "ProviderRejectedError",
    "Runtime",
    "SamplingParams",
    "SelectionError",
    "TextPrompt",
    "TokensPrompt",
    "VllmPortError",
    "__version__",
    "hookimpl",
    "load",
    "load_many",
]
