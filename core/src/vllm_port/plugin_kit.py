"""The parts platform plugins share, so that each plugin file holds only what is special to its vendor.

Each part is parameterised by what differs between vendors (a name, a torch device module, a graph
type); the in-tree plugins and the ``vllm-port new-plugin`` scaffold call the same ones from their
own ``@hookimpl`` functions:

- :class:`DeviceAllocator`: flat byte buffers through torch's caching allocator of one torch device
  module (``torch.cuda``, ``torch.xpu``...), free memory counting what that cache holds unused.
- :class:`StreamGraphCapture`: capture a step on a side stream after warm-up runs and replay it with
  one launch, through one device module's graph API (CUDA graphs; HIP graphs, which ROCm builds of
  torch expose under ``torch.cuda``).
- :func:`device_context_created`: the answer of ``vllm_port_platform_context_created`` for a
  device that torch drives through one module.

A plugin module writes every hook it answers as a function of its own, so a reader (and grep) finds
each one where the entry point names it: ``plugins/vllm-port-xpu/src/vllm_port_xpu/plugin.py`` is
one to read (its allocator a :class:`DeviceAllocator`, its context check
:func:`device_context_created`), and ``vllm-port new-plugin`` writes the same shape.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import torch

from .graph_capture import GraphCapture, capturing
from .memory import Allocator

__all__ = ["DeviceAllocator", "StreamGraphCapture", "device_context_created", "torch_device_module"]

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


def device_context_created(torch_device: str) -> bool:
    """Whether this process has made a device context through ``torch.<torch_device>`` (its ``is_initialized()``).

    What a plugin's ``vllm_port_platform_context_created`` answers for a device torch drives
    through one module (``"cuda"``, also for ROCm builds; ``"xpu"``). A torch build without the
    module (releases before the device's support) has made no context.
    """
    module = getattr(torch, torch_device, None)
    return bool(module is not None and module.is_initialized())


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

    Warm-up runs go on a side stream, one a device for the whole process (lazy initialisation, Triton
    compiles and autotuning must not be captured), then one run is captured into a graph of
    ``graph_type``; every graph of one capture object shares one memory pool, as the graphs of one
    runner should.

    :param name: what doctor and reports call it, e.g. ``"cuda graphs"``.
    :param torch_device: the torch module with the graph API (``Stream``, ``stream``,
        ``current_stream``, ``current_device``, ``graph``, ``graph_pool_handle``).
    :param graph_type: the name of its graph class in that module (``"CUDAGraph"``).
    """

    #: the warm-up stream of each (device module, device index), shared by every capture of the process. A stream
    #: of its own per capture came from torch's pool of 32, and cuBLAS keeps a workspace (32 MiB on Hopper) for
    #: every stream it has run on until the process ends: on an H100, 1 GiB stayed allocated after an engine closed.
    #: Keyed by the module's stream class too, so a test that fakes the module never gets another's stream.
    _warmup_streams: ClassVar[dict[tuple[str, int, type], Any]] = {}

    def __init__(self, name: str, torch_device: str = "cuda", graph_type: str = "CUDAGraph") -> None:
        self.name = name
        self.torch_device = torch_device
        self.graph_type = graph_type
        self.pool = torch_device_module(torch_device).graph_pool_handle()

    def _warmup_stream(self, module: ModuleType) -> Any:
        key = (self.torch_device, module.current_device(), module.Stream)
        if key not in self._warmup_streams:
            self._warmup_streams[key] = module.Stream()
        return self._warmup_streams[key]

    def capture(self, step: Callable[[], T], warmup: int = 2) -> Callable[[], T]:
        module = torch_device_module(self.torch_device)
        side = self._warmup_stream(module)
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
