"""Graph capture: record a step's kernel launches once and replay them with one call.

Platforms that can (CUDA graphs, HIP graphs) answer ``vllm_port_graph_capture``; a runner captures
its decode step per batch size and replays it, removing the per-kernel launch cost.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TypeVar

__all__ = ["GraphCapture"]

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
        raw addresses, and memory freed under it is reused by other tensors.
        """
