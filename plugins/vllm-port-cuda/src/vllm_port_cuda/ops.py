"""CUDA providers: the shared Triton kernels, launched with the configuration of the GPUs present, and on Hopper
(sm_90) the Gluon prefill attention (:mod:`vllm_port_cuda.hopper_prefill`).

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
#: The Hopper prefill kernel goes above the Triton one it falls back to.
HOPPER_PRIORITY = 25

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

    - sm_90 and newer with Hopper's shared memory: :data:`~vllm_port_cuda.triton_targets.CUDA` (128 x 64 tiles, two
      programs a multiprocessor, TMA);
    - Ampere data-centre parts (sm_80, sm_87): ``CUDA_AMPERE`` (128 x 64 tiles, row gathers);
    - the rest (consumer Ampere, Ada, consumer Blackwell, Turing): ``CUDA_COMPACT`` (64 x 64 tiles), one stage
      deep where two do not fit.

    No capability known (no GPU seen: the kernels run, if at all, in Triton's interpreter) gives ``CUDA``.
    """
    from .triton_targets import CUDA, CUDA_AMPERE, CUDA_COMPACT

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
    """Every Triton provider, configured for the visible GPUs (:func:`target_for`; imports triton), and the Hopper
    prefill where every visible GPU is an sm_90 part (:func:`hopper_providers`)."""
    from vllm_port.kernels.triton import providers as triton_providers

    capabilities = visible_capabilities()
    found = triton_providers(target_for(capabilities), TRITON_PRIORITY)
    return found + hopper_providers(capabilities, found)


def hopper_providers(capabilities: Sequence[tuple[int, int]], triton_found: Sequence[Provider]) -> list[Provider]:
    """The Gluon prefill attention (:mod:`vllm_port_cuda.hopper_prefill`) where every visible GPU is sm_90 (its
    ``wgmma`` is Hopper's alone) and Triton has Gluon; else none.

    It serves bf16 and fp16. An input outside its scope (:func:`~vllm_port_cuda.hopper_prefill.unsupported`: another
    head size, 16-token blocks, a window or soft cap...) runs the Triton provider of ``triton_found`` instead: a
    provider must serve every valid input of the dtypes it claims.
    """
    if not capabilities or any(major != 9 for major, _ in capabilities):
        return []
    try:
        from . import hopper_prefill
    except ImportError:  # a Triton without Gluon's Hopper API (before 3.5)
        return []
    import torch

    from vllm_port.ops.attention import check_prefill_attention

    fallback = next(p for p in triton_found if p.op == "prefill_attention")

    def prefill_attention(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        max_query_len: int,
        scale: float,
        sliding_window: int = 0,
        soft_cap: float = 0.0,
    ) -> torch.Tensor:
        """Causal varlen attention over the paged cache: the Hopper kernel, or the Triton one outside its scope."""
        args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale)
        check_prefill_attention(*args, sliding_window, soft_cap)
        why = hopper_prefill.unsupported(query, key_cache, value_cache, sliding_window, soft_cap, max_query_len)
        if why or query.device.type != "cuda":
            return fallback.fn(*args, sliding_window, soft_cap)
        return hopper_prefill.hopper_prefill_attention(*args)

    name, dtypes = "gluon_hopper_prefill_attention", frozenset({torch.bfloat16, torch.float16})
    return [Provider("prefill_attention", name, prefill_attention, HOPPER_PRIORITY, dtypes, fallback.supports)]
