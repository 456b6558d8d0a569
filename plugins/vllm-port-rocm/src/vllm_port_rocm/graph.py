"""HIP graphs: capture a decode step once, replay it with one launch.

A ROCm build of torch exposes HIP graphs through the ``torch.cuda`` graph API (``torch.cuda.CUDAGraph``,
``torch.cuda.graph``, ``torch.cuda.graph_pool_handle``), as it exposes HIP streams as ``torch.cuda.Stream``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vllm_port.graph import GraphCapture

T = TypeVar("T")


class HipGraphCapture(GraphCapture):
    """Captures on a side stream after warm-up runs, as HIP graphs (like CUDA graphs) require."""

    name = "hip graphs"

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # graphs of one runner share memory

    def capture(self, step: Callable[[], T], warmup: int = 2) -> Callable[[], T]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # lazy initialisation, Triton compiles and autotuning must not be captured
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()  # a hipGraph_t on ROCm builds
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()

        def replay() -> T:
            graph.replay()
            return outputs

        return replay
