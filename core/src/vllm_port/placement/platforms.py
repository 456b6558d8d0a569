"""Several platforms loaded at once: one :class:`~vllm_port.Runtime` per platform name, the first the default.

::

    platforms = vllm_port.load_many(["cuda", "cpu"])   # discover once, select each
    platforms.default                                  # the cuda Runtime: where the engine's batch lives
    platforms["cpu"].bind(torch.bfloat16)              # each platform binds its own providers
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from ..discovery import discover
from ..errors import SelectionError
from ..runtime import Runtime, select

__all__ = ["Platforms", "load_many"]


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

    def device(self, name: str) -> torch.device:
        """The torch device of platform ``name`` (device 0 of it)."""
        return self[name].device


def load_many(devices: Sequence[str], plugins: str | None = None, probe_timeout_s: float | None = None) -> Platforms:
    """Discover installed plugins once and select each platform of ``devices`` (the first is the default).

    :param devices: platform names, e.g. ``["cuda", "cpu"]``; ``"auto"`` is the best available platform
        (loaded once when it is also named).
    :param plugins: allow/deny list, as ``VLLM_PORT_PLUGINS``.
    :raises SelectionError: for an empty list, a name listed twice, or a platform unknown or unavailable here.
    """
    if isinstance(devices, str) or not devices:
        raise SelectionError(f"load_many: devices is {devices!r}; give a list of platform names, e.g. ['cuda', 'cpu']")
    discovery = discover(plugins, probe_timeout_s=probe_timeout_s)
    runtimes: list[Runtime] = []
    for name in devices:
        selected, reason = select(discovery, None if name == "auto" else name)
        chosen = selected.description.name if selected.description else name
        if name == "auto" and (chosen in devices or any(r.platform.name == chosen for r in runtimes)):
            continue  # "auto" picked a platform that is also named: load it once, where it is named
        runtimes.append(Runtime(discovery, selected, reason))
    return Platforms(runtimes)
