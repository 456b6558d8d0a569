"""CUDA providers: the shared Triton kernels, launched with the configuration of the GPUs present.

The tiles of the attention kernels must fit a multiprocessor's shared memory, which differs threefold
across NVIDIA's parts, and their TMA loads need Hopper. :func:`target_for` picks the Triton target
from the visible devices' compute capabilities (read from NVML, no CUDA context; else from torch).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_port.ops import Provider

from . import platform

if TYPE_CHECKING:
    from vllm_port.kernels.triton import TritonTarget

#: Above the CPU plugin's torch providers (10) and the reference; a vendor library may go higher.
TRITON_PRIORITY = 20

#: The most shared memory one block may opt into, in KiB, per compute capability (NVIDIA's CUDA C++
#: Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_KIB = {
    (7, 0): 96,
    (7, 2): 96,
    (7, 5): 64,
    (8, 0): 163,
    (8, 6): 99,
    (8, 7): 163,
    (8, 9): 99,
    (9, 0): 227,
    (10, 0): 227,
    (10, 3): 227,
    (12, 0): 99,
    (12, 1): 99,
}

#: The shared memory a part must offer for each target, in KiB (bf16, head 128). The Hopper target's prefill
#: program takes 96 KiB and was tuned for two of them on one multiprocessor, hence 192; the others' largest
#: attention tiles need the figure given.
_HOPPER_NEEDS_KIB = 192
_AMPERE_NEEDS_KIB = 128
_COMPACT_NEEDS_KIB = 80


def shared_memory_kib(capability: tuple[int, int]) -> int:
    """Shared memory one block may use on compute capability ``capability``; an unlisted one is assumed to
    have the least of its major version's listed parts (or 64 KiB), so that the tiles chosen always fit."""
    if capability in SHARED_MEMORY_KIB:
        return SHARED_MEMORY_KIB[capability]
    same_major = [kib for (major, _), kib in SHARED_MEMORY_KIB.items() if major == capability[0]]
    return min(same_major, default=64)


def target_for(capabilities: Sequence[tuple[int, int]]) -> TritonTarget:
    """The Triton target whose tiles fit every device of ``capabilities`` (compute capabilities ``(major, minor)``).

    - sm_90 and newer with Hopper's shared memory: :data:`~vllm_port.kernels.triton.CUDA` (128 x 64 tiles, two
      programs a multiprocessor, TMA);
    - Ampere data-centre parts (sm_80, sm_87): ``CUDA_AMPERE`` (128 x 64 tiles, row gathers);
    - the rest (consumer Ampere, Ada, consumer Blackwell, Turing): ``CUDA_COMPACT`` (64 x 64 tiles), one stage
      deep where two do not fit.

    No capability known (no GPU seen: the kernels run, if at all, in Triton's interpreter) gives ``CUDA``.
    """
    from vllm_port.kernels.triton import CUDA, CUDA_AMPERE, CUDA_COMPACT

    if not capabilities:
        return CUDA
    smem = min(shared_memory_kib(cc) for cc in capabilities)
    if min(capabilities) >= (9, 0) and smem >= _HOPPER_NEEDS_KIB:
        return CUDA
    if smem >= _AMPERE_NEEDS_KIB:
        return CUDA_AMPERE
    if smem >= _COMPACT_NEEDS_KIB:
        return CUDA_COMPACT
    return replace(CUDA_COMPACT, name="cuda-compact-1stage", attn_stages=1)


def visible_capabilities() -> list[tuple[int, int]]:
    """Compute capabilities of the visible GPUs: from NVML (no CUDA context), else from torch, else none."""
    nvml = platform.read_nvml(platform.parse_visible_devices(os.environ.get(platform.VISIBLE_ENV)))
    if nvml is not None and nvml[0]:
        return [d.compute_capability for d in nvml[0]]
    import torch

    if torch.version.cuda is not None and torch.cuda.is_available():
        return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
    return []


def providers() -> list[Provider]:
    """Every Triton provider, configured for the visible GPUs (:func:`target_for`; imports triton)."""
    from vllm_port.kernels.triton import providers as triton_providers

    return triton_providers(target_for(visible_capabilities()), TRITON_PRIORITY)
