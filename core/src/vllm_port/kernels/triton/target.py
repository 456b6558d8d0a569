"""Launch choices of one GPU family for the shared Triton kernels.

The kernels are written once; a plugin passes the :class:`TritonTarget` of its hardware, and each
launcher derives block sizes, warps and pipeline stages from it. A vendor tunes its target, not
the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CUDA", "INTERPRETER", "ROCM", "XPU", "TritonTarget"]


@dataclass(frozen=True)
class TritonTarget:
    """Launch configuration of one GPU family.

    Attributes:
        name: a label for reports (``"cuda"``, ``"rocm"``...).
        warp_size: threads that execute in lock step: 32 on NVIDIA, 64 on AMD CDNA, 16/32 on Intel.
        max_warps: the most warps one row kernel (norms, activations) may use.
        elementwise_block: elements one program handles in flat element-wise kernels.
        attn_block_m: query rows per program in prefill attention.
        attn_block_n: keys per step in prefill and decode attention.
        attn_warps: warps per attention program.
        attn_stages: software-pipelining depth of attention's K/V loads.
    """

    name: str
    warp_size: int = 32
    max_warps: int = 16
    elementwise_block: int = 1024
    attn_block_m: int = 128
    attn_block_n: int = 64
    attn_warps: int = 8
    attn_stages: int = 3


#: NVIDIA (Ampere, Hopper): large tiles, deep pipelines for cp.async / TMA; element-wise blocks of
#: 2048 measured best on an H200 (dev/tune_elementwise.py).
CUDA = TritonTarget("cuda", elementwise_block=2048)
#: AMD CDNA (MI200/MI300): 64-wide wavefronts, shallow pipelines (LDS is smaller than Hopper's shared memory).
ROCM = TritonTarget("rocm", warp_size=64, max_warps=16, attn_block_m=128, attn_block_n=64, attn_warps=4, attn_stages=1)
#: Intel Data Center GPU Max (Xe-HPC): sub-groups of 16/32, moderate tiles.
XPU = TritonTarget("xpu", warp_size=32, max_warps=32, attn_block_m=64, attn_block_n=64, attn_warps=8, attn_stages=2)
#: The CPU interpreter (TRITON_INTERPRET=1) used by CI: small tiles keep it fast.
INTERPRETER = TritonTarget(
    "interpreter", max_warps=4, elementwise_block=256, attn_block_m=16, attn_block_n=16, attn_warps=4, attn_stages=1
)
