"""Device properties the shared kernels size their launches by, answered by the selected platform.

A kernel never names a vendor's torch module (``torch.cuda``, ``torch.xpu``): it asks
:func:`compute_units` for a device's multiprocessor count. The answer comes from the platform: the
runtime publishes the selected platform's probed devices (:func:`publish`), whose
``DeviceInfo.compute_units`` a probe fills where it can read it cheaply (the ROCm probe from KFD).
Where the probe left it at 0, the count is read once from torch's device properties of that device
type (``multi_processor_count``, or ``gpu_subslice_count`` on Intel GPUs); where torch has none
(the CPU, where Triton's interpreter runs), the caller's default stands.

Answers are cached per device, so a launcher pays one dictionary look-up per call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .platform import DeviceInfo

__all__ = ["compute_units", "publish"]

_published: dict[str, tuple[DeviceInfo, ...]] = {}
_cache: dict[tuple[torch.device, int], int] = {}

#: Names torch's device properties give the multiprocessor count, by vendor.
_TORCH_FIELDS = ("multi_processor_count", "gpu_subslice_count")


def publish(device_type: str, devices: Sequence[DeviceInfo]) -> None:
    """Make ``devices`` (a probe's, in torch's index order) the answer for tensors on ``device_type``.

    The runtime calls it for the platform it selects; a later call replaces the earlier answer.
    """
    _published[device_type] = tuple(devices)
    for key in [k for k in _cache if k[0].type == device_type]:
        del _cache[key]


def compute_units(device: torch.device, default: int) -> int:
    """Multiprocessors of ``device``: SMs on NVIDIA, CUs on AMD, Xe cores on Intel; a host-side query, no sync.

    :param default: the answer when neither the platform nor torch knows one (the CPU interpreter).
    """
    key = (device, default)
    found = _cache.get(key)
    if found is None:
        found = _from_platform(device) or _from_torch(device) or default
        _cache[key] = found
    return found


def _from_platform(device: torch.device) -> int:
    devices = _published.get(device.type, ())
    index = device.index if device.index is not None else 0
    return devices[index].compute_units if index < len(devices) else 0


def _from_torch(device: torch.device) -> int:
    if device.type == "cpu":
        return 0
    module = getattr(torch, device.type, None)
    read = getattr(module, "get_device_properties", None)
    if read is None:
        return 0
    properties = read(device)
    for name in _TORCH_FIELDS:
        value = getattr(properties, name, 0)
        if isinstance(value, int) and value > 0:
            return value
    return 0
