"""CUDA graphs: capture a decode step once, replay it with one launch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from vllm_port.graph import GraphCapture

T = TypeVar("T")


class CudaGraphCapture(GraphCapture):
    """Captures on a side stream after warm-up runs, as CUDA graphs require."""

    name = "cuda graphs"

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()  # graphs of one runner share memory

    def capture(self, step: Callable[[], T], warmup: int = 2) -> Callable[[], T]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # lazy initialisation and autotuning must not be captured
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step()

        def replay() -> T:
            graph.replay()
            return outputs

        return replay
