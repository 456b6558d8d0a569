"""The CPU platform: always available; the probe reads the host from /proc and torch, nothing more."""

from __future__ import annotations

import os
import platform as _host

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult

from . import native

#: ISA extensions that change which CPU kernels are fast, as /proc/cpuinfo spells them.
INTERESTING_FLAGS = (
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
    "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "bf16", "i8mm",
)  # fmt: skip


def describe() -> PlatformDescription:
    """The CPU platform's static facts: lowest priority, so any available accelerator wins."""
    return PlatformDescription(
        name="cpu",
        device_type="cpu",
        priority=0,
        dist_backend="gloo",
        graph_capture=False,
        compile_backend="inductor",
        memory_tiers=("device",),
        # the decode attention reads one KV head's rows of each block: side by side, they stream (about a
        # quarter less time a call at the engine's shape, docs/results/engine-cpu.md)
        kv_head_major=True,
    )


def probe(cpuinfo_path: str = "/proc/cpuinfo", meminfo_path: str = "/proc/meminfo") -> ProbeResult:
    """Describe the host: usable cores, memory, ISA flags and torch's vector capability."""
    cpuinfo = _read(cpuinfo_path)
    flags = _cpu_flags(cpuinfo)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = _meminfo_bytes(_read(meminfo_path), "MemTotal")
    model = _cpuinfo_field(cpuinfo, "model name") or _host.processor() or _host.machine()
    capabilities = {
        "arch": _host.machine(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "isa": [f for f in INTERESTING_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_bytes": memory,
        "native_attention": native.check()[1],
    }
    device = DeviceInfo(name=model, total_memory=memory, arch=_host.machine())
    reason = f"host CPU: {model}, {cores} cores usable; native kernels: {capabilities['native_attention']}"
    return ProbeResult(True, reason, (device,), capabilities)


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def _cpuinfo_field(cpuinfo: str, key: str) -> str:
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return ""


def _cpu_flags(cpuinfo: str) -> set[str]:
    # x86 says "flags", Arm says "Features"
    return set((_cpuinfo_field(cpuinfo, "flags") or _cpuinfo_field(cpuinfo, "Features")).split())


def _meminfo_bytes(meminfo: str, key: str) -> int:
    for line in meminfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name == key:
            return int(value.split()[0]) * 1024  # /proc/meminfo counts kB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if key == "MemTotal" else 0


def available_memory(meminfo_path: str = "/proc/meminfo") -> int:
    """Bytes the kernel says a new allocation can take without swapping."""
    return _meminfo_bytes(_read(meminfo_path), "MemAvailable")
