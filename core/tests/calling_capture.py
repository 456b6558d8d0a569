"""Graph capture's stand-in on CPU for the tests: "replaying" calls the captured step again, what a replay computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_port.graph_capture import GraphCapture


class CallingCapture(GraphCapture):
    """Graph capture's stand-in on CPU: "replaying" calls the step again (what a replay computes)."""

    name = "calling capture (CPU stand-in)"

    def __init__(self) -> None:
        self.captured: list[Callable[[], Any]] = []

    def capture(self, step, warmup=2):
        for _ in range(warmup):
            step()
        self.captured.append(step)
        return step
