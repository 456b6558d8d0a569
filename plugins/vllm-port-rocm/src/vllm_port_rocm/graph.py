"""HIP graphs: capture a decode step once, replay it with one launch.

A ROCm build of torch exposes HIP graphs through the ``torch.cuda`` graph API (``torch.cuda.CUDAGraph``,
``torch.cuda.graph``, ``torch.cuda.graph_pool_handle``), as it exposes HIP streams as ``torch.cuda.Stream``.
"""

from __future__ import annotations

from vllm_port.plugin_kit import StreamGraphCapture


class HipGraphCapture(StreamGraphCapture):
    """Captures on a side stream after warm-up runs, as HIP graphs (like CUDA graphs) require."""

    def __init__(self) -> None:
        super().__init__("hip graphs", torch_device="cuda", graph_type="CUDAGraph")  # a hipGraph_t on ROCm builds
