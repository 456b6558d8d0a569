"""The XPU plugin's launch configuration of the shared Triton kernels: Intel Data Center GPU Max (Xe-HPC).

Core's shared Triton kernels (:mod:`vllm_port.kernels.triton`) are written once; each launcher derives
block sizes, warps and pipeline stages from the :class:`~vllm_port.kernels.triton_target.TritonTarget`
it is given. Tune it with the measurement that justifies each value, in the comment beside it.
Plain data: importing this module needs no Triton.
"""

from __future__ import annotations

from vllm_port.kernels.triton_target import TritonTarget

__all__ = ["XPU"]

#: Intel Data Center GPU Max (Xe-HPC): sub-groups of 16/32, moderate tiles. ``linear`` stays with
#: oneDNN (``linear_max_rows=0``) until the split-K kernel is measured against it.
XPU = TritonTarget(
    "xpu",
    warp_size=32,
    max_warps=32,
    attn_block_m=64,
    attn_block_n=64,
    attn_warps=8,
    attn_stages=2,
    linear_max_rows=0,
)
