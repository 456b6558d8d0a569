"""Graph capture: record a step's kernel launches once and replay them with one call.

Platforms that can (CUDA graphs, HIP graphs) answer ``vllm_port_graph_capture``; a runner captures
its decode step per batch size and replays it, removing the per-kernel launch cost.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["GraphCapture", "capturing", "is_capturing"]

_state = threading.local()


def is_capturing() -> bool:
    """Whether this thread is recording a step into a device graph: nothing may read a device tensor on the host."""
    return getattr(_state, "depth", 0) > 0


@contextmanager
def capturing() -> Iterator[None]:
    """Mark this thread as recording a device graph (what :func:`is_capturing` reports).

    A :class:`GraphCapture` wraps its recording run in it, and so does every caller that captures
    (``vllm_port.flat.capture.DecodeGraphs``), so checks that would read values on the host (the
    op input validation, debug mode) stand aside without asking which device is recording.
    """
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


T = TypeVar("T")


class GraphCapture(abc.ABC):
    """Captures a callable over static tensors and returns a function that replays it."""

    name: str = "graph capture"

    @abc.abstractmethod
    def capture(self, step: Callable[[], T], warmup: int = 2) -> Callable[[], T]:
        """Run ``step`` ``warmup`` times, capture one run, and return its replay.

        ``step`` reads and writes only tensors it closes over; their addresses are frozen into
        the graph, so a caller refills those tensors in place before each replay. The replay
        returns the tensors ``step`` returned during capture, refreshed by each replay. The caller
        keeps ``step``, and so what it closes over, alive as long as it replays: the graph holds
        raw addresses, and memory freed under it is reused by other tensors. Implementations record
        inside :func:`capturing`.
        """
