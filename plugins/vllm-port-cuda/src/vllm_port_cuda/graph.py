"""CUDA graphs: capture a decode step once, replay it with one launch."""

from __future__ import annotations

from vllm_port.plugin_kit import StreamGraphCapture


class CudaGraphCapture(StreamGraphCapture):
    """Captures on a side stream after warm-up runs, as CUDA graphs require."""

    def __init__(self) -> None:
        super().__init__("cuda graphs", torch_device="cuda", graph_type="CUDAGraph")
