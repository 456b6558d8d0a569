"""Several platforms loaded at once: one :class:`~vllm_port.Runtime` per platform name, the first the default.

::

    platforms = vllm_port.load_many(["cuda", "cpu"])   # discover once, select each
    platforms.default                                  # the cuda Runtime: where the engine's batch lives
    platforms["cpu"].bind(torch.bfloat16)              # each platform binds its own providers
    platforms.device("cuda:1")                         # a placement target: device 1 of the cuda platform

A placement *target* is a platform name (its device 0) or ``NAME:INDEX`` for another device of it
(``"cuda:1"``: a pipeline split over the GPUs of one process); ``NAME:0`` is written ``NAME``. A
target's kernels run with its device made current (:func:`device_context`, :func:`run_on_device`):
Triton launches on the current device, where torch's own ops follow their tensors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..discovery import discover
from ..errors import SelectionError
from ..memory import Allocator
from ..runtime import Runtime, select

__all__ = ["Platforms", "device_context", "load_many", "run_on_device", "split_target"]


def split_target(target: str) -> tuple[str, int]:
    """``"cuda:1"`` -> ``("cuda", 1)``; ``"cpu"`` -> ``("cpu", 0)``."""
    name, _, index = target.partition(":")
    return name, int(index) if index else 0


def normal_target(target: str) -> str:
    """``"cuda:0"`` -> ``"cuda"`` (device 0 is the platform's own); other targets as they are."""
    name, index = split_target(target)
    return name if index == 0 else f"{name}:{index}"


def run_on_device(fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` called with ``device`` the current device of its type (restored after)."""
    module = torch.get_device_module(device.type)

    def on_device(*args: Any, **kwargs: Any) -> Any:
        with module.device(device.index):
            return fn(*args, **kwargs)

    # a plain name for fx's code generation, as the transfer nodes have
    on_device.__module__, on_device.__name__, on_device.__qualname__ = "placement", "on_device", "on_device"
    return on_device


def device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``device`` made current where it is a non-zero accelerator device (its kernels launch there); else nothing."""
    if device.type == "cpu" or not device.index:
        return contextlib.nullcontext()
    return torch.get_device_module(device.type).device(device.index)


class Platforms(Mapping[str, Runtime]):
    """Runtimes by platform name, in the order they were asked for; the first is :attr:`default`."""

    def __init__(self, runtimes: Sequence[Runtime]) -> None:
        if not runtimes:
            raise SelectionError("Platforms needs at least one runtime; load_many(['cpu']) loads one")
        self._runtimes: dict[str, Runtime] = {}
        for runtime in runtimes:
            name = runtime.platform.name
            if name in self._runtimes:
                raise SelectionError(f"platform {name!r} is listed twice; name each platform once")
            self._runtimes[name] = runtime
        self._allocators: dict[str, Allocator] = {}

    @classmethod
    def of(cls, runtime: Runtime | Platforms) -> Platforms:
        """``runtime`` as a set of one platform (a :class:`Platforms` is returned as is)."""
        return runtime if isinstance(runtime, Platforms) else cls([runtime])

    def __getitem__(self, name: str) -> Runtime:
        try:
            return self._runtimes[name]
        except KeyError:
            raise SelectionError(
                f"platform {name!r} is not loaded; loaded: {', '.join(self._runtimes)}. "
                f"Load it too, e.g. vllm_port.load_many([..., {name!r}]) or LLM(devices=[..., {name!r}])"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._runtimes

    def __iter__(self) -> Iterator[str]:
        return iter(self._runtimes)

    def __len__(self) -> int:
        return len(self._runtimes)

    def __repr__(self) -> str:
        return f"Platforms({', '.join(self._runtimes)}; default {self.default.platform.name})"

    @property
    def default(self) -> Runtime:
        """The first platform: the engine's batch, sampling and (by default) every node live there."""
        return next(iter(self._runtimes.values()))

    def runtime(self, target: str) -> Runtime:
        """The runtime of target ``target`` (``"cuda:1"`` -> the cuda runtime)."""
        return self[split_target(target)[0]]

    def device_count(self, name: str) -> int:
        """How many devices platform ``name``'s probe found (at least 1)."""
        probe = self[name].selected.probe
        return max(1, probe.device_count if probe is not None else 1)

    def device(self, target: str) -> torch.device:
        """The torch device of ``target``: a platform name (its device 0) or ``NAME:INDEX``.

        :raises SelectionError: for an index past the devices the platform's probe found.
        """
        name, index = split_target(target)
        runtime = self[name]
        if index == 0:
            return runtime.device
        count = self.device_count(name)
        if index >= count:
            raise SelectionError(
                f"{target!r}: platform {name!r} has {count} device(s) here (0-{count - 1}); name one of them"
            )
        device_type = runtime.platform.device_type
        return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, index)

    def allocator(self, target: str) -> Allocator:
        """The device-tier allocator of ``target``: the platform's for device 0, the same kind for another index.

        Allocators answer for one device (the platform's device 0); another device of an
        accelerator gets a copy of it pointed at that device, whose buffers
        :class:`~vllm_port.placement.PlacedKVCache` checks land there. Host memory has one allocator.
        """
        found = self._allocators.get(target)
        if found is None:
            base = self.runtime(target).allocator()
            device = self.device(target)
            if split_target(target)[1] == 0 or device.type == "cpu":
                found = base
            else:
                found = copy.copy(base)
                Allocator.__init__(found, f"{base.name} (device {device.index})", device)  # fresh books
                if hasattr(found, "_index"):  # core's TorchDeviceAllocator keeps its index apart
                    found._index = device.index
            self._allocators[target] = found
        return found


def load_many(
    devices: Sequence[str],
    plugins: str | None = None,
    probe_timeout_s: float | None = None,
    sources: Mapping[str, str] | None = None,
) -> Platforms:
    """Discover installed plugins once and select each platform of ``devices`` (the first is the default).

    :param devices: platform names, e.g. ``["cuda", "cpu"]``; ``"auto"`` is the best available platform
        (loaded once when it is also named).
    :param plugins: allow/deny list, as ``VLLM_PORT_PLUGINS``.
    :param sources: who named each platform (``{"cuda": "the placement policy's platform"}``), as its
        error says it; ``--device`` for one not in it.
    :raises SelectionError: for an empty list, a name listed twice, or a platform unknown or unavailable here.
    """
    if isinstance(devices, str) or not devices:
        raise SelectionError(f"load_many: devices is {devices!r}; give a list of platform names, e.g. ['cuda', 'cpu']")
    discovery = discover(plugins, probe_timeout_s=probe_timeout_s)
    runtimes: list[Runtime] = []
    for name in devices:
        selected, reason = select(discovery, None if name == "auto" else name, (sources or {}).get(name))
        chosen = selected.description.name if selected.description else name
        if name == "auto" and (chosen in devices or any(r.platform.name == chosen for r in runtimes)):
            continue  # "auto" picked a platform that is also named: load it once, where it is named
        runtimes.append(Runtime(discovery, selected, reason))
    return Platforms(runtimes)
