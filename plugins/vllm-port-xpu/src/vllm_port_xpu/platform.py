"""The XPU platform: Intel GPUs through torch's XPU build.

The probe never creates a device context. ``torch.xpu.device_count()`` asks Level Zero (or SYCL)
without initialising torch's XPU state, but every per-device fact torch offers (name, memory,
architecture, fp64 and bf16 support) comes from ``get_device_properties``, which initialises it. So
the probe reports devices by index only, and their details are read at bind.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult
from vllm_port.platform import CapabilityValue

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


def probe() -> ProbeResult:
    """Count the visible Intel GPUs without creating a device context."""
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
    devices = tuple(DeviceInfo(f"Intel GPU {i}") for i in range(count))
    caps: dict[str, CapabilityValue] = {
        "xpu_version": xpu_build() or "",
        # find_spec looks for the package without importing it: importing IPEX loads its native libraries.
        "ipex_installed": importlib.util.find_spec("intel_extension_for_pytorch") is not None,
    }
    reason = (
        f"{count} Intel GPU(s) visible to {build}; names, memory and architecture are read at bind, "
        "since torch reads them only with a device context"
    )
    return ProbeResult(True, reason, devices, caps)
