"""Guards around the memory and comm parts a plugin supplies: its reports checked, its failures named.

* An allocator's ``mem_info()`` is what the KV cache sizes itself by, so one that lies (free memory
  above the total, negative or non-integer bytes, more than the device has) would size the cache
  into an out-of-memory crash, or an overcommitted host into the kernel's OOM killer.
  :func:`mem_info_problem` says what is wrong; the runtime then falls back to core's allocator for
  the device type, where core has one (strict mode refuses), or stops naming the plugin.
* A plugin's point-to-point or collectives part that fails (a timeout, a dead peer, a bug) raises
  whatever its backend raised. :class:`GuardedPointToPoint` and :class:`GuardedCollectives` turn
  that into a :class:`~vllm_port.errors.CommTimeoutError` (timeouts) or
  :class:`~vllm_port.errors.CommError` naming the plugin, the part and the call, with the way
  around it. A comm failure cannot fall back: the other ranks are already inside the call, so the
  run stops. Core's own torch.distributed parts already name the rank and the call, and are not wrapped.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

from .comm import Collectives, PointToPoint
from .errors import CommCapabilityError, CommError, CommInitError, CommInputError, CommTimeoutError
from .memory import Allocator

__all__ = ["GuardedCollectives", "GuardedPointToPoint", "mem_info_problem"]

#: A plugin's total may exceed what core measures by this share (another count of reserved memory).
TOTAL_SLACK = 0.05


def mem_info_problem(allocator: Allocator, measured: Allocator | None = None) -> str | None:
    """What is wrong with ``allocator.mem_info()``, or ``None``.

    :param measured: core's own allocator for the device type, whose total is what the device has;
        ``None`` where core cannot measure the device.
    """
    try:
        info = allocator.mem_info()
    except Exception as exc:
        return f"mem_info() raised {type(exc).__name__}: {exc}"
    if not isinstance(info, (tuple, list)) or len(info) != 2:
        return f"mem_info() returned {info!r}, not a (free, total) pair of byte counts"
    free, total = info
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in info):
        return f"mem_info() returned (free={free!r}, total={total!r}); both must be ints of bytes"
    if total <= 0 or not 0 <= free <= total:
        return f"mem_info() reports free={free:,} and total={total:,} bytes; it must hold 0 <= free <= total, total > 0"
    if measured is not None:
        try:
            _, device_total = measured.mem_info()
        except Exception:  # core cannot measure it here: nothing to compare with
            return None
        if free > device_total or total > device_total * (1 + TOTAL_SLACK):
            return (
                f"mem_info() reports free={free:,} and total={total:,} bytes, but the device has {device_total:,} "
                f"bytes in all (as core's {measured.name} allocator measures it)"
            )
    return None


def _named(exc: Exception, plugin: str, part: str, call: str) -> Exception:
    if isinstance(exc, (CommInputError, CommCapabilityError, CommInitError)):
        return exc  # the caller's input, call or setup: the contract's own message says what to change
    where = f"{call} of {part} {plugin!r}"
    fix = (
        f"check the peers and the network, raise the process group's timeout (init_from_env(timeout_s=...)), or deny "
        f"plugin {plugin!r} (VLLM_PORT_PLUGINS=-{plugin}) to run on torch.distributed's default"
    )
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError) or "timeout" in text.lower() or "timed out" in text.lower():
        return CommTimeoutError(f"{where} timed out ({text}); every rank stops here. To fix: {fix}")
    return CommError(f"{where} failed ({text}). To fix: {fix}")


class _Guard:
    def __init__(self, inner: Any, plugin: str) -> None:
        self.inner, self.plugin = inner, plugin
        self.name = inner.name
        self.capabilities = inner.capabilities

    def _call(self, call: str, *args: Any) -> Any:
        try:
            return getattr(self.inner, call)(*args)
        except Exception as exc:
            named = _named(exc, self.plugin, self._part, call)
            if named is exc:
                raise
            raise named from exc

    def __getattr__(self, name: str) -> Any:  # anything else the plugin's part offers
        return getattr(self.inner, name)


class GuardedPointToPoint(_Guard, PointToPoint):
    """A plugin's point-to-point part whose failures name the plugin and the call."""

    _part = "point-to-point part"

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._call("send", tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        self._call("recv", tensor, src)

    def batch_isend_irecv(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        self._call("batch_isend_irecv", sends, recvs)


class GuardedCollectives(_Guard, Collectives):
    """A plugin's collectives part whose failures name the plugin and the call."""

    _part = "collectives part"

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._call("all_reduce", tensor)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._call("all_gather", tensor, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._call("reduce_scatter", tensor, dim)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._call("broadcast", tensor, src)

    def barrier(self) -> None:
        self._call("barrier")
