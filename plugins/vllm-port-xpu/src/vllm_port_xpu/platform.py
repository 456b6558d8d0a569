"""The XPU platform: Intel GPUs through torch's XPU build.

The probe never creates a device context. ``torch.xpu.device_count()`` asks Level Zero (or SYCL)
without initialising torch's XPU state, but every per-device fact torch offers (name, memory,
architecture, fp64 and bf16 support) comes from ``get_device_properties``, which initialises it. So
the probe reports devices by index only, and their details are read at bind, unless this process
already holds an XPU context (then reading them costs nothing new) or the caller passes a reader.

:func:`device_capabilities` maps the properties torch reports (``torch.xpu.get_device_properties``,
fields filled from SYCL's ``sycl::info::device`` queries) to capabilities.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult
from vllm_port.platform import CapabilityValue

from . import ipex_ops

#: Variables that hide Intel GPUs from the runtime: Level Zero's, then SYCL's.
VISIBLE_ENVS = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
XPU_WHEELS = "https://download.pytorch.org/whl/xpu"


def describe() -> PlatformDescription:
    """The XPU platform's static facts: XCCL for comm, no graph capture."""
    return PlatformDescription(
        name="xpu",
        device_type="xpu",
        priority=90,
        dist_backend="xccl",
        graph_capture=False,
        compile_backend="inductor",
        memory_tiers=("device", "pinned_host"),
    )


def xpu_build() -> str | None:
    """The SYCL/oneAPI version torch was built against (``torch.version.xpu``), or ``None`` for a build without XPU."""
    return getattr(torch.version, "xpu", None)


#: Intel GPU families by the marketing name SYCL reports (``sycl::info::device::name``).
GPU_FAMILIES = (
    ("Data Center GPU Max", "xe-hpc"),  # Ponte Vecchio
    ("Data Center GPU Flex", "xe-hpg"),
    ("Arc(TM) A", "xe-hpg"),  # Alchemist
    ("Arc(TM) B", "xe2-hpg"),  # Battlemage
)


def gpu_family(name: str) -> str:
    """The Xe family of a device name: ``"Intel(R) Data Center GPU Max 1550"`` -> ``"xe-hpc"``; else ``"unknown"``."""
    return next((family for marker, family in GPU_FAMILIES if marker in name), "unknown")


def device_capabilities(props: Any) -> dict[str, CapabilityValue]:
    """Capabilities from one device's properties, as ``torch.xpu.get_device_properties`` reports them.

    Reads ``name``, ``total_memory`` (bytes, ``global_mem_size``), ``max_compute_units`` (EUs),
    ``sub_group_sizes`` (``sycl::info::device::sub_group_sizes``), ``has_fp64`` and ``has_fp16``
    (``sycl::aspect::fp64``/``fp16``) and, where the torch release has them, ``has_bfloat16_conversions``
    and ``has_subgroup_matrix_multiply_accumulate`` (XMX matrix engines). ``max_sub_group_size`` is the
    widest sub-group, the lane count a Triton warp maps to.
    """
    sizes = sorted(int(s) for s in getattr(props, "sub_group_sizes", ()) or ())
    return {
        "device_name": str(props.name),
        "gpu_family": gpu_family(str(props.name)),
        "total_memory": int(props.total_memory),
        "compute_units": int(props.max_compute_units),
        "sub_group_sizes": [str(s) for s in sizes],
        "max_sub_group_size": sizes[-1] if sizes else 0,
        "fp64": bool(props.has_fp64),
        "fp16": bool(getattr(props, "has_fp16", False)),
        "bf16_conversions": bool(getattr(props, "has_bfloat16_conversions", False)),
        "xmx": bool(getattr(props, "has_subgroup_matrix_multiply_accumulate", False)),
    }


def _xe_cores(props: Any) -> int:
    """Xe cores (``gpu_subslice_count``), the unit the shared kernels size their grids by; 0 when unreported."""
    value = getattr(props, "gpu_subslice_count", 0)
    return value if isinstance(value, int) and value > 0 else 0


def _context_properties() -> Callable[[int], Any] | None:
    """``get_device_properties`` when this process already holds an XPU context, else ``None``."""
    if hasattr(torch, "xpu") and torch.xpu.is_initialized():
        return torch.xpu.get_device_properties
    return None


def probe(read_properties: Callable[[int], Any] | None = None) -> ProbeResult:
    """Count the visible Intel GPUs without creating a device context.

    :param read_properties: reads device ``i``'s properties; by default ``torch.xpu.get_device_properties``
        only when a context already exists, so that the probe never creates one.
    """
    build = f"torch {torch.__version__}"
    count = torch.xpu.device_count() if hasattr(torch, "xpu") else 0
    if count == 0:
        if xpu_build() is None:
            return ProbeResult(
                False,
                f"{build} has no XPU support (torch.version.xpu is None); "
                f"install torch's XPU build (pip install torch --index-url {XPU_WHEELS})",
            )
        env = ", ".join(f"{k}={os.environ[k]!r}" for k in VISIBLE_ENVS if k in os.environ)
        if env:
            fix = f"set {env} to GPUs that sycl-ls lists, or unset it"
        else:
            fix = "install Intel's GPU driver with its Level Zero loader, and check that sycl-ls lists a GPU"
        return ProbeResult(False, f"{build} (XPU {xpu_build()}) sees no Intel GPU; {fix}")
    if xpu_build() is not None:
        build += f" (XPU {xpu_build()})"
    caps: dict[str, CapabilityValue] = {
        "xpu_version": xpu_build() or "",
        # find_spec looks for the package without importing it: importing IPEX loads its native libraries.
        "ipex_installed": importlib.util.find_spec("intel_extension_for_pytorch") is not None,
        # torch's XPU wheels bring it; without it the plugin offers no Triton providers (ops.providers)
        "triton_installed": importlib.util.find_spec("triton") is not None,
        # its version when it matches torch, else why its providers are not registered
        "ipex": ipex_ops.check()[1],
    }
    reader = read_properties or _context_properties()
    if reader is None:
        devices = tuple(DeviceInfo(f"Intel GPU {i}") for i in range(count))
        reason = (
            f"{count} Intel GPU(s) visible to {build}; names, memory and architecture are read at bind, "
            "since torch reads them only with a device context"
        )
        return ProbeResult(True, reason, devices, caps)
    props: Sequence[Any] = [reader(i) for i in range(count)]
    devices = tuple(DeviceInfo(str(p.name), int(p.total_memory), gpu_family(str(p.name)), _xe_cores(p)) for p in props)
    # Features of the first visible device: the one rank 0 of an engine runs on.
    caps.update(device_capabilities(props[0]))
    summary = ", ".join(f"{n}x {name}" for name, n in Counter(d.name for d in devices).items())
    return ProbeResult(True, f"{count} Intel GPU(s) visible to {build}: {summary}", devices, caps)
