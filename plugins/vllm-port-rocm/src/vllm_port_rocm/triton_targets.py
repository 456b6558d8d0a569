"""The ROCm plugin's launch configuration of the shared Triton kernels: AMD CDNA (MI200/MI300).

Core's shared Triton kernels (:mod:`vllm_port.kernels.triton`) are written once; each launcher derives
block sizes, warps and pipeline stages from the :class:`~vllm_port.kernels.triton_target.TritonTarget`
it is given. An RDNA target would be a second one here. Plain data: importing this module needs no Triton.
"""

from __future__ import annotations

from vllm_port.kernels.triton_target import LinearTiles, TritonTarget

__all__ = ["ROCM"]

#: AMD CDNA (MI200/MI300): 64-wide wavefronts, shallow pipelines (LDS is smaller than Hopper's shared memory).
#: ``linear`` stays with hipBLASLt (``linear_max_rows=0``) until the split-K kernel is measured against it;
#: its tiles are single-buffered to fit 64 KiB of LDS.
ROCM = TritonTarget(
    "rocm",
    warp_size=64,
    max_warps=16,
    attn_block_m=128,
    attn_block_n=64,
    attn_warps=4,
    attn_stages=1,
    linear_max_rows=0,
    linear_fma=LinearTiles(32, 256, 4, 1),
    linear_dot=LinearTiles(32, 128, 4, 1),
)
