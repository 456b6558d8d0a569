"""The CUDA platform: NVIDIA GPUs through a CUDA build of torch.

The probe never creates a CUDA context. It reads torch's build facts, ``torch.cuda.device_count()``
(answered by NVML or the driver without initialising torch's CUDA state) and, through nvidia-ml-py,
NVML for each device's name, memory and compute capability. What NVML cannot tell is read at bind.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult
from vllm_port.platform import CapabilityValue

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def describe() -> PlatformDescription:
    """The CUDA platform's static facts: NCCL for comm, CUDA graphs for step capture."""
    return PlatformDescription(
        name="cuda",
        device_type="cuda",
        priority=100,
        dist_backend="nccl",
        graph_capture=True,
        compile_backend="inductor",
        memory_tiers=("device", "pinned_host"),
        # a key tile of the attention kernels inside one block: TMA loads instead of row gathers
        # (prefill 1.37x faster on an H200, docs/results/attention-h200.md)
        kv_block_size=128,
    )


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML reports it: marketing name, bytes of memory, compute capability ``(major, minor)``."""

    name: str
    total_memory: int
    compute_capability: tuple[int, int]


def arch_name(major: int, minor: int) -> str:
    """The ``sm_XY`` tag nvcc and torch use for compute capability ``major.minor``: (9, 0) -> ``"sm_90"``."""
    return f"sm_{major}{minor}"


def capabilities(major: int, minor: int) -> dict[str, CapabilityValue]:
    """Tensor-core features of compute capability ``major.minor``, per NVIDIA's CUDA C++ Programming Guide.

    A100 is 8.0, L40S 8.9, H100/H200 9.0, B200 10.0.
    """
    cc = (major, minor)
    return {
        "compute_capability": f"{major}.{minor}",
        "arch": arch_name(major, minor),
        "bf16": cc >= (8, 0),  # Ampere brought bf16 tensor cores
        "fp8": cc >= (8, 9),  # Ada (8.9) and Hopper brought e4m3/e5m2 tensor cores
        "tma": cc >= (9, 0),  # the tensor memory accelerator exists from Hopper on
        "wgmma": major == 9,  # warpgroup MMA is Hopper-only; Blackwell replaced it with tcgen05
        "fp4": major >= 10,  # Blackwell brought fp4 tensor cores
    }


def parse_visible_devices(spec: str | None) -> list[str] | None:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, or ``None`` when it is unset (every GPU is visible).

    Entries are indices, ``GPU-<uuid>`` or ``MIG-<uuid>``; like CUDA, reading stops at the first
    entry that is none of these (so ``"0,-1,1"`` keeps only ``"0"``, and ``""`` hides every GPU).
    """
    if spec is None:
        return None
    entries: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def read_nvml(visible: Sequence[str] | None) -> tuple[list[NvmlDevice], str] | None:
    """The visible GPUs as NVML describes them, in ``visible``'s order, and the driver version.

    NVML numbers GPUs in PCI bus order, as CUDA does with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; CUDA's
    default order differs only on machines with mixed GPU models. The list stops at the first entry
    NVML cannot resolve (a MIG instance, an unknown index), leaving those devices to bind.

    :return: ``None`` when nvidia-ml-py is not installed or NVML does not start (no NVIDIA driver).
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        entries = visible if visible is not None else [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        devices: list[NvmlDevice] = []
        for entry in entries:
            handle = _nvml_handle(pynvml, entry)
            if handle is None:
                break
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = _text(pynvml.nvmlDeviceGetName(handle))
            devices.append(NvmlDevice(name, int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), (major, minor)))
        return devices, _text(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def probe() -> ProbeResult:
    """Count the visible NVIDIA GPUs and describe them from NVML, without creating a CUDA context."""
    build = f"torch {torch.__version__}"
    if torch.version.hip:
        return ProbeResult(
            False,
            f"{build} is a ROCm (HIP {torch.version.hip}) build, which drives AMD GPUs; "
            "use vllm-port-rocm for them, or install a CUDA build of torch for NVIDIA GPUs",
        )
    if torch.version.cuda is None:
        return ProbeResult(
            False, f"{build} has no CUDA support (torch.version.cuda is None); install a CUDA build of torch"
        )
    build += f" (CUDA {torch.version.cuda})"
    count = torch.cuda.device_count()
    spec = os.environ.get(VISIBLE_ENV)
    if count == 0:
        if spec is not None:
            return ProbeResult(
                False,
                f"{build} sees no NVIDIA GPU with {VISIBLE_ENV}={spec!r}; "
                f"set {VISIBLE_ENV} to GPU indices or UUIDs that nvidia-smi -L lists, or unset it",
            )
        return ProbeResult(
            False, f"{build} sees no NVIDIA GPU; check that nvidia-smi lists one and that the NVIDIA driver is loaded"
        )
    nvml = read_nvml(parse_visible_devices(spec))
    found, driver = nvml if nvml is not None else ([], "")
    found = found[:count]
    devices = [DeviceInfo(d.name, d.total_memory, arch_name(*d.compute_capability)) for d in found]
    devices += [DeviceInfo(f"NVIDIA GPU {i}") for i in range(len(found), count)]
    caps: dict[str, CapabilityValue] = {"cuda_runtime": torch.version.cuda}
    if found:
        # Features of the first visible device: the one rank 0 of an engine runs on.
        caps.update(capabilities(*found[0].compute_capability))
        caps["driver_version"] = driver
    summary = ", ".join(f"{n}x {name}" for name, n in Counter(d.name for d in devices).items())
    if nvml is None:
        reason = (
            f"{count} NVIDIA GPU(s) visible to {build}; names, memory and compute capability are read at bind "
            "because NVML did not answer (install nvidia-ml-py, or check the NVIDIA driver)"
        )
    elif len(found) < count:
        reason = (
            f"{count} NVIDIA GPU(s) visible to {build}: {summary}; NVML could not resolve {count - len(found)} "
            f"of them (MIG instances or {VISIBLE_ENV} entries it does not know), so their details are read at bind"
        )
    else:
        reason = f"{count} NVIDIA GPU(s) visible to {build}: {summary}, driver {driver}"
    return ProbeResult(True, reason, tuple(devices), caps)


def _nvml_handle(pynvml: Any, entry: str) -> Any:
    try:
        if entry.isdigit():
            return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
        if entry.startswith("GPU-"):
            return pynvml.nvmlDeviceGetHandleByUUID(entry)
    except pynvml.NVMLError:
        pass
    return None  # MIG instances have no NVML handle of their own at this level


def _text(value: str | bytes) -> str:
    # older nvidia-ml-py releases return bytes where current ones return str
    return value.decode() if isinstance(value, bytes) else value
