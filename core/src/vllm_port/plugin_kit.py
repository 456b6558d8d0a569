"""What every platform plugin has in common, so that each plugin file holds only what is special to its vendor.

Three parts, each parameterised by what differs between vendors (a name, a torch device module, a
graph type); the in-tree plugins and the ``vllm-port new-plugin`` scaffold use the same ones:

- :class:`DeviceAllocator`: flat byte buffers through torch's caching allocator of one torch device
  module (``torch.cuda``, ``torch.xpu``...), free memory counting what that cache holds unused.
- :class:`StreamGraphCapture`: capture a step on a side stream after warm-up runs and replay it with
  one launch, through one device module's graph API (CUDA graphs; HIP graphs, which ROCm builds of
  torch expose under ``torch.cuda``).
- :func:`platform_hooks`: the hook implementations every platform plugin writes the same way (API
  range, describe, probe, context check, providers, allocator, graph capture), built from the
  plugin's parts. A plugin module takes them with ``globals().update(platform_hooks(...))`` and
  writes by hand, with ``@hookimpl``, only the hooks special to it.

A minimal platform plugin module::

    from vllm_port.plugin_kit import DeviceAllocator, platform_hooks

    from . import ops, platform

    globals().update(
        platform_hooks(
            api_range=">=1.0,<2",
            describe=platform.describe,
            probe=platform.probe,
            torch_device="cuda",
            providers=ops.providers,
            allocator=lambda: DeviceAllocator("mychip allocator", "cuda"),
        )
    )
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch

from .graph_capture import GraphCapture, capturing
from .hookspecs import hookimpl
from .memory import Allocator
from .ops import Provider
from .platform import PlatformDescription, ProbeResult

__all__ = ["DeviceAllocator", "StreamGraphCapture", "platform_hooks", "torch_device_module"]

T = TypeVar("T")


def torch_device_module(name: str) -> ModuleType:
    """torch's module for a device type (``"cuda"`` -> ``torch.cuda``), looked up at each call.

    Looked up late, so a torch build without the module fails only when it is used, and tests can
    replace the module's functions.

    :raises RuntimeError: when this torch build has no such module.
    """
    module = getattr(torch, name, None)
    if not isinstance(module, ModuleType):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.{name} module; install a torch build with {name} support"
        )
    return module


class DeviceAllocator(Allocator):
    """Flat byte buffers in an accelerator's memory, on torch's caching allocator of one device module.

    Free and total come from the driver (``mem_get_info``); bytes torch's cache holds but has not
    handed out count as free, since the driver counts them as used but a new buffer reuses them
    first. ``empty_cache`` gives them back to the driver.

    :param name: the allocator's name in errors and reports, e.g. ``"cuda allocator"``.
    :param device: the device its buffers live on.
    :param torch_device: the torch module that drives it (default: the device's type; ``"cuda"``
        for ROCm builds, whose HIP allocator torch exposes as ``torch.cuda``).
    """

    def __init__(self, name: str, device: torch.device | str, torch_device: str | None = None) -> None:
        super().__init__(name, device)
        self.torch_device = torch_device or self.device.type

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _mem_info(self) -> tuple[int, int]:
        module = torch_device_module(self.torch_device)
        free, total = module.mem_get_info(self.device)
        cached = module.memory_reserved(self.device) - module.memory_allocated(self.device)
        return free + cached, total

    def _empty_cache(self) -> None:
        torch_device_module(self.torch_device).empty_cache()


class StreamGraphCapture(GraphCapture):
    """Graph capture through a torch device module's graph API (``torch.cuda``: CUDA and HIP graphs).

    Warm-up runs go on a side stream (lazy initialisation, Triton compiles and autotuning must not
    be captured), then one run is captured into a graph of ``graph_type``; every graph of one
    capture object shares one memory pool, as the graphs of one runner should.

    :param name: what doctor and reports call it, e.g. ``"cuda graphs"``.
    :param torch_device: the torch module with the graph API (``Stream``, ``stream``,
        ``current_stream``, ``graph``, ``graph_pool_handle``).
    :param graph_type: the name of its graph class in that module (``"CUDAGraph"``).
    """

    def __init__(self, name: str, torch_device: str = "cuda", graph_type: str = "CUDAGraph") -> None:
        self.name = name
        self.torch_device = torch_device
        self.graph_type = graph_type
        self.pool = torch_device_module(torch_device).graph_pool_handle()

    def capture(self, step: Callable[[], T], warmup: int = 2) -> Callable[[], T]:
        module = torch_device_module(self.torch_device)
        side = module.Stream()
        side.wait_stream(module.current_stream())
        with module.stream(side):
            for _ in range(warmup):
                step()
        module.current_stream().wait_stream(side)
        graph = getattr(module, self.graph_type)()
        with module.graph(graph, pool=self.pool), capturing():
            outputs = step()

        def replay() -> T:
            graph.replay()
            return outputs

        return replay


def platform_hooks(
    *,
    api_range: str,
    describe: Callable[[], PlatformDescription],
    probe: Callable[[], ProbeResult],
    torch_device: str | None = None,
    providers: Callable[[], list[Provider]] | None = None,
    allocator: Callable[[], Allocator] | None = None,
    graph_capture: Callable[[], GraphCapture] | None = None,
) -> dict[str, Callable[..., Any]]:
    """The standard hook implementations of a platform plugin, keyed by hook name.

    Each answers exactly as a hand-written ``@hookimpl`` would; those left ``None`` are not defined,
    so core serves its default for them (see :mod:`vllm_port.hookspecs`).

    :param api_range: the contract range the plugin implements (``vllm_port_api_range``).
    :param describe: answers ``vllm_port_platform_describe`` (constants only).
    :param probe: answers ``vllm_port_platform_probe`` (a cheap query, no device context).
    :param torch_device: the torch module whose ``is_initialized()`` answers
        ``vllm_port_platform_context_created`` (``"cuda"``, ``"xpu"``); ``None`` for a platform
        without device contexts (CPU), which leaves that hook out. A torch build without the module
        has created no context.
    :param providers: answers ``vllm_port_providers``.
    :param allocator: builds the device allocator; ``vllm_port_allocator`` calls it only for this
        plugin's own platform (the name ``describe()`` gives) and answers ``None`` for any other.
    :param graph_capture: builds the graph capture; ``vllm_port_graph_capture`` calls it only for
        this plugin's own platform.
    :return: ``{hook name: implementation}``, for ``globals().update(...)`` in the plugin module.
    """
    hooks: dict[str, Callable[..., Any]] = {}

    def vllm_port_api_range() -> str:
        return api_range

    def vllm_port_platform_describe() -> PlatformDescription:
        return describe()

    def vllm_port_platform_probe() -> ProbeResult:
        return probe()

    for function in (vllm_port_api_range, vllm_port_platform_describe, vllm_port_platform_probe):
        hooks[function.__name__] = hookimpl(function)

    if torch_device is not None:

        def vllm_port_platform_context_created() -> bool:
            module = getattr(torch, torch_device, None)  # torch releases before a device's support lack its module
            return bool(module is not None and module.is_initialized())

        hooks["vllm_port_platform_context_created"] = hookimpl(vllm_port_platform_context_created)

    if providers is not None:

        def vllm_port_providers() -> list[Provider]:
            return providers()

        hooks["vllm_port_providers"] = hookimpl(vllm_port_providers)

    if allocator is not None:

        def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
            return allocator() if platform.name == describe().name else None

        hooks["vllm_port_allocator"] = hookimpl(vllm_port_allocator)

    if graph_capture is not None:

        def vllm_port_graph_capture(platform: PlatformDescription) -> GraphCapture | None:
            return graph_capture() if platform.name == describe().name else None

        hooks["vllm_port_graph_capture"] = hookimpl(vllm_port_graph_capture)

    return hooks
