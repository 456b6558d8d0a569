"""The ROCm platform: AMD GPUs through a ROCm (HIP) build of torch, which keeps the ``cuda`` device type.

The probe never creates a HIP context. It reads ``torch.version.hip``, ``torch.cuda.device_count()``
(answered by amdsmi or HIP without initialising torch's state) and the KFD topology the amdgpu driver
publishes in sysfs: one node per CPU socket and per GPU, each a ``properties`` file of ``key value``
lines, with ``mem_banks/<n>/properties`` beside it.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult
from vllm_port.platform import CapabilityValue

KFD_NODES = "class/kfd/kfd/topology/nodes"
#: KFD heap types of a GPU's own memory (HSA_MEM_HEAP_TYPE_FB_PUBLIC and _FB_PRIVATE in kfd_topology.h).
FRAMEBUFFER_HEAPS = (1, 2)
#: The matrix cores of each gfx target, per AMD's CDNA and RDNA ISA references.
MFMA_ARCHS = ("gfx908", "gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")
#: fp8 formats: MI300 (gfx94x) implements the FNUZ variants; MI350 (gfx950) and RDNA4 the OCP ones.
FP8_FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")

T = TypeVar("T")


def describe() -> PlatformDescription:
    """The ROCm platform's static facts: RCCL (torch's ``nccl`` backend) for comm, HIP graphs for capture."""
    return PlatformDescription(
        name="rocm",
        device_type="cuda",
        priority=100,
        dist_backend="nccl",
        graph_capture=True,
        compile_backend="inductor",
        memory_tiers=("device", "pinned_host"),
    )


@dataclass(frozen=True)
class KfdGpu:
    """One GPU node of the KFD topology.

    Attributes:
        node: its KFD node number. arch: its LLVM target, e.g. ``"gfx942"``.
        name: the board's product name where the driver publishes it, else ``"AMD <arch>"``.
        memory: bytes of its own memory (VRAM). compute_units: its CU count (0 when not reported).
    """

    node: int
    arch: str
    name: str
    memory: int
    compute_units: int


def gfx_arch(target_version: int) -> str:
    """The LLVM target of a KFD ``gfx_target_version``: 90402 -> ``"gfx942"``, 90010 -> ``"gfx90a"``.

    KFD packs ``major * 10000 + minor * 100 + stepping``; LLVM writes minor and stepping as one hex digit each.
    """
    major, rest = divmod(target_version, 10000)
    minor, stepping = divmod(rest, 100)
    return f"gfx{major}{minor:x}{stepping:x}"


def arch_capabilities(arch: str) -> dict[str, CapabilityValue]:
    """Wavefront size, matrix cores and fp8 format of a gfx target.

    GCN and CDNA (gfx9) run 64-wide wavefronts, RDNA (gfx10 to gfx12) 32-wide ones by default; CDNA
    from gfx908 has MFMA matrix cores, RDNA3 and RDNA4 (gfx11, gfx12) have WMMA.
    """
    major = arch[3:-2]  # "gfx942" -> "9", "gfx1100" -> "11"
    rdna = major in ("10", "11", "12")
    if arch in MFMA_ARCHS:
        matrix_cores = "mfma"
    elif major in ("11", "12"):
        matrix_cores = "wmma"
    else:
        matrix_cores = "none"
    if arch in FP8_FNUZ_ARCHS:
        fp8 = "fnuz"
    elif arch == "gfx950" or major == "12":
        fp8 = "ocp"
    else:
        fp8 = "none"
    return {"gfx_arch": arch, "wavefront_size": 32 if rdna else 64, "matrix_cores": matrix_cores, "fp8": fp8}


def parse_properties(text: str) -> dict[str, int]:
    """The ``key value`` lines of a KFD ``properties`` file, as integers; other lines are skipped."""
    props: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key and value.strip().isdigit():
            props[key] = int(value)
    return props


def read_kfd_gpus(sysfs_root: str = "/sys") -> list[KfdGpu]:
    """The GPU nodes of the KFD topology under ``sysfs_root``, in node order; empty when there is none.

    CPU nodes (``gfx_target_version 0``) are skipped. Memory is the sum of the node's framebuffer
    banks, else its ``local_mem_size``; the name is the ``product_name`` amdgpu publishes for the
    node's render device (server boards only, read from their FRU), else ``"AMD <arch>"``.
    """
    nodes_dir = os.path.join(sysfs_root, KFD_NODES)
    try:
        nodes = sorted(int(n) for n in os.listdir(nodes_dir) if n.isdigit())
    except OSError:
        return []
    gpus: list[KfdGpu] = []
    for node in nodes:
        node_dir = os.path.join(nodes_dir, str(node))
        props = parse_properties(_read(os.path.join(node_dir, "properties")))
        if not props.get("gfx_target_version"):
            continue
        arch = gfx_arch(props["gfx_target_version"])
        product = ""
        if "drm_render_minor" in props:
            product = _read(
                os.path.join(sysfs_root, f"class/drm/renderD{props['drm_render_minor']}/device/product_name")
            )
        simd_per_cu = props.get("simd_per_cu", 0)
        cus = props.get("simd_count", 0) // simd_per_cu if simd_per_cu else 0
        memory = _framebuffer_bytes(node_dir) or props.get("local_mem_size", 0)
        gpus.append(KfdGpu(node, arch, product.strip() or f"AMD {arch}", memory, cus))
    return gpus


def select_visible(items: Sequence[T], spec: str | None) -> list[T]:
    """The items a ``*_VISIBLE_DEVICES`` value keeps, in its order; all of them when it is unset.

    Reading stops at the first index out of range, as HIP's does. A value naming devices by UUID
    cannot be matched to KFD nodes here, so it keeps every item (and the probe keeps the first ones).
    """
    if spec is None:
        return list(items)
    kept: list[T] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith("GPU-"):
            return list(items)
        if not entry.isdigit() or int(entry) >= len(items):
            break
        kept.append(items[int(entry)])
    return kept


def probe(sysfs_root: str = "/sys") -> ProbeResult:
    """Count the visible AMD GPUs and describe them from the KFD topology, without creating a HIP context."""
    build = f"torch {torch.__version__}"
    if torch.version.hip is None:
        if torch.version.cuda is not None:
            return ProbeResult(
                False,
                f"{build} is a CUDA {torch.version.cuda} build, which drives NVIDIA GPUs; "
                "use vllm-port-cuda for them, or install a ROCm build of torch for AMD GPUs",
            )
        return ProbeResult(
            False, f"{build} has no ROCm support (torch.version.hip is None); install a ROCm build of torch"
        )
    build += f" (HIP {torch.version.hip})"
    kfd = read_kfd_gpus(sysfs_root)
    # ROCr applies ROCR_VISIBLE_DEVICES first; HIP then indexes what is left with HIP_VISIBLE_DEVICES
    # or, when that is unset, CUDA_VISIBLE_DEVICES.
    rocr = os.environ.get("ROCR_VISIBLE_DEVICES")
    hip_env = "HIP_VISIBLE_DEVICES" if "HIP_VISIBLE_DEVICES" in os.environ else "CUDA_VISIBLE_DEVICES"
    visible = select_visible(select_visible(kfd, rocr), os.environ.get(hip_env))
    count = torch.cuda.device_count()
    topology = os.path.join(sysfs_root, KFD_NODES)
    if count == 0:
        env = ", ".join(f"{k}={os.environ[k]!r}" for k in ("ROCR_VISIBLE_DEVICES", hip_env) if k in os.environ)
        if not kfd:
            return ProbeResult(
                False,
                f"{build} sees no AMD GPU and {topology} lists none; load the amdgpu driver (modprobe amdgpu), "
                "or pass /dev/kfd and /dev/dri into the container",
            )
        archs = ", ".join(sorted({g.arch for g in kfd}))
        fix = f"check that {env} names GPUs that rocm-smi lists, and " if env else "check "
        return ProbeResult(
            False,
            f"{build} sees no AMD GPU although {topology} lists {len(kfd)} ({archs}); "
            f"{fix}that this user can open /dev/kfd and /dev/dri/renderD* (groups video and render)",
        )
    found = visible[:count]
    devices = [DeviceInfo(g.name, g.memory, g.arch, g.compute_units) for g in found]
    devices += [DeviceInfo(f"AMD GPU {i}") for i in range(len(found), count)]
    caps: dict[str, CapabilityValue] = {
        "hip_version": torch.version.hip,
        # find_spec looks for the package without importing it (importing AITER loads its JIT modules).
        "aiter_installed": importlib.util.find_spec("aiter") is not None,
        # torch's ROCm wheels bring it; without it the plugin offers no Triton providers (ops.providers)
        "triton_installed": importlib.util.find_spec("triton") is not None,
    }
    if found:
        # Features of the first visible device: the one rank 0 of an engine runs on.
        caps.update(arch_capabilities(found[0].arch))
        caps["compute_units"] = found[0].compute_units
    summary = ", ".join(f"{n}x {name} ({arch})" for (name, arch), n in Counter((g.name, g.arch) for g in found).items())
    if not found:
        reason = (
            f"{count} AMD GPU(s) visible to {build}; names, memory and architecture are read at bind "
            f"because {topology} lists no GPU here (a container without the host's /sys, say)"
        )
    elif len(found) < count:
        reason = (
            f"{count} AMD GPU(s) visible to {build}: {summary}; the KFD topology describes only {len(found)}, "
            "so the others' details are read at bind"
        )
    else:
        reason = f"{count} AMD GPU(s) visible to {build}: {summary}"
    return ProbeResult(True, reason, tuple(devices), caps)


def _framebuffer_bytes(node_dir: str) -> int:
    banks_dir = os.path.join(node_dir, "mem_banks")
    try:
        banks = os.listdir(banks_dir)
    except OSError:
        return 0
    total = 0
    for bank in banks:
        props = parse_properties(_read(os.path.join(banks_dir, bank, "properties")))
        if props.get("heap_type") in FRAMEBUFFER_HEAPS:
            total += props.get("size_in_bytes", 0)
    return total


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""
