"""What a plugin says about its hardware: a static description and a cheap probe.

``PlatformDescription`` never touches the hardware (it is answered from constants), so a plugin's
name and device type are known even when its probe fails. ``ProbeResult`` is the cheap look at the
machine: it must not create a device context, compile a kernel or allocate device memory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeviceInfo", "PlatformDescription", "ProbeResult", "validate_description", "validate_probe"]

#: Capability values are plain JSON values so reports and ``doctor --json`` can carry them.
CapabilityValue = bool | int | float | str | list[str]


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a platform, as the probe saw it.

    Attributes:
        name: the vendor's name for the device, e.g. ``"NVIDIA H200"``.
        total_memory: bytes of memory the device has (0 when the probe could not read it cheaply).
        arch: architecture tag: ``"sm_90"``, ``"gfx942"``, ``"x86_64"``...
        compute_units: the multiprocessors the shared kernels size their grids by (SMs on NVIDIA,
            CUs on AMD, Xe cores on Intel); 0 when the probe could not read it cheaply, and then
            :func:`vllm_port.device_properties.compute_units` reads it from torch when a kernel asks.
    """

    name: str
    total_memory: int = 0
    arch: str = ""
    compute_units: int = 0


@dataclass(frozen=True)
class PlatformDescription:
    """A platform's static facts, answered without touching the hardware.

    Attributes:
        name: the platform's short name (``"cpu"``, ``"cuda"``); users select it with ``--device``.
        device_type: the ``torch.device`` type its tensors live on (``"cpu"``, ``"cuda"``, ``"xpu"``).
        priority: higher wins when several platforms are available and the user names none.
        dist_backend: the ``torch.distributed`` backend for comm (``"gloo"``, ``"nccl"``, ``"xccl"``).
        graph_capture: whether the platform can capture and replay a step (CUDA/HIP graphs).
        compile_backend: the ``torch.compile`` backend the platform prefers.
        memory_tiers: the tiers blocks may live in, fastest first (``"device"``, ``"pinned_host"``).
        kv_block_size: tokens per KV-cache block the platform's attention kernels run fastest with;
            engines use it unless the user chooses (``LLM(block_size=...)``).
        kv_head_major: whether the device tier's KV cache keeps each KV head's rows of a block side by side
            in memory (stored ``[num_blocks, num_kv_heads, block_size, head_size]``). The caches the ops are
            given keep the contract's shape, ``[num_blocks, block_size, num_kv_heads, head_size]``, with those
            strides, so every provider must take strided caches (the conformance suite gives them such
            caches too). A kernel that reads one KV head's rows then reads a block's in one run: the CPU
            decode attention is bound by those reads (``docs/results/engine-cpu.md``).
    """

    name: str
    device_type: str
    priority: int
    dist_backend: str
    graph_capture: bool = False
    compile_backend: str = "inductor"
    memory_tiers: tuple[str, ...] = ("device",)
    kv_block_size: int = 16
    kv_head_major: bool = False

    def __post_init__(self) -> None:
        size = self.kv_block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"platform {self.name!r}: kv_block_size must be a positive int (tokens per KV-cache block), got {size!r}"
            )


@dataclass(frozen=True)
class ProbeResult:
    """What a cheap probe of the machine found.

    Attributes:
        available: whether the platform can run here now.
        reason: one sentence saying why (always set; for an unavailable platform, what to do).
        devices: the devices found (empty when unavailable).
        capabilities: flat, JSON-valued facts (ISA flags, compute capability, wavefront size...).
    """

    available: bool
    reason: str
    devices: tuple[DeviceInfo, ...] = ()
    capabilities: Mapping[str, CapabilityValue] = field(default_factory=dict)

    @property
    def device_count(self) -> int:
        """The number of devices found."""
        return len(self.devices)


def validate_description(value: Any) -> PlatformDescription:
    """Return ``value`` if it is a well-formed description, else raise ``ValueError`` saying what is wrong."""
    if not isinstance(value, PlatformDescription):
        raise ValueError(f"vllm_port_platform_describe must return a PlatformDescription, got {type(value).__name__}")
    for attr in ("name", "device_type", "dist_backend", "compile_backend"):
        text = getattr(value, attr)
        if not isinstance(text, str) or not text or not text.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"PlatformDescription.{attr} must be a non-empty identifier, got {text!r}")
    if not isinstance(value.priority, int) or isinstance(value.priority, bool):
        raise ValueError(f"PlatformDescription.priority must be an int, got {value.priority!r}")
    if not isinstance(value.graph_capture, bool):
        raise ValueError(f"PlatformDescription.graph_capture must be a bool, got {value.graph_capture!r}")
    if not isinstance(value.kv_head_major, bool):
        raise ValueError(f"PlatformDescription.kv_head_major must be a bool, got {value.kv_head_major!r}")
    if not value.memory_tiers or not all(isinstance(t, str) and t for t in value.memory_tiers):
        raise ValueError(f"PlatformDescription.memory_tiers must name at least one tier, got {value.memory_tiers!r}")
    return value


def validate_probe(value: Any) -> ProbeResult:
    """Return ``value`` if it is a consistent probe result, else raise ``ValueError`` saying what is wrong."""
    if not isinstance(value, ProbeResult):
        raise ValueError(f"vllm_port_platform_probe must return a ProbeResult, got {type(value).__name__}")
    if not isinstance(value.available, bool):
        raise ValueError(f"ProbeResult.available must be a bool, got {value.available!r}")
    if not isinstance(value.reason, str) or not value.reason.strip():
        raise ValueError("ProbeResult.reason must be a non-empty sentence saying why the platform is (un)available")
    if not all(isinstance(d, DeviceInfo) for d in value.devices):
        raise ValueError(f"ProbeResult.devices must hold DeviceInfo objects, got {value.devices!r}")
    if value.available and not value.devices:
        raise ValueError("ProbeResult says available=True but lists no devices")
    for device in value.devices:
        if not isinstance(device.total_memory, int) or device.total_memory < 0:
            raise ValueError(f"DeviceInfo.total_memory must be a non-negative int, got {device.total_memory!r}")
        if (
            not isinstance(device.compute_units, int)
            or isinstance(device.compute_units, bool)
            or device.compute_units < 0
        ):
            raise ValueError(f"DeviceInfo.compute_units must be a non-negative int, got {device.compute_units!r}")
    if not isinstance(value.capabilities, Mapping):
        raise ValueError(f"ProbeResult.capabilities must be a mapping, got {type(value.capabilities).__name__}")
    for key, cap in value.capabilities.items():
        if not isinstance(key, str) or not _is_capability_value(cap):
            raise ValueError(f"capability {key!r}={cap!r} is not a JSON value (bool, int, float, str, list of str)")
    return value


def _is_capability_value(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(isinstance(v, str) for v in value)
    return isinstance(value, (bool, int, str))
