"""The CPU plugin: probe against recorded /proc files and the host allocator (providers: test_cpu_ops.py)."""

from pathlib import Path

import torch

from vllm_port.memory import HostMemoryAllocator
from vllm_port.platform import PlatformDescription, validate_description, validate_probe
from vllm_port_cpu import platform, plugin

DATA = Path(__file__).parent / "data"


def test_probe_reads_isa_flags_and_memory_from_a_sapphire_rapids_host():
    result = validate_probe(platform.probe(str(DATA / "cpuinfo-sapphire-rapids.txt"), str(DATA / "meminfo.txt")))
    assert result.available and result.device_count == 1
    assert result.devices[0].name == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"} <= set(result.capabilities["isa"])
    assert result.capabilities["memory_bytes"] == 263741712 * 1024


def test_probe_reads_arm_features():
    result = platform.probe(str(DATA / "cpuinfo-neoverse-v2.txt"), str(DATA / "meminfo.txt"))
    assert {"asimd", "sve", "sve2", "bf16", "i8mm"} <= set(result.capabilities["isa"])
    assert "avx2" not in result.capabilities["isa"]


def test_probe_of_this_host_is_valid_and_description_is_lowest_priority():
    validate_probe(platform.probe())
    description = validate_description(platform.describe())
    assert description.priority == 0 and description.dist_backend == "gloo"


def test_the_allocator_hook_serves_pageable_host_memory_for_the_cpu_platform_only():
    alloc = plugin.vllm_port_allocator(platform.describe())
    assert type(alloc) is HostMemoryAllocator and not alloc.pinned and alloc.name == "cpu host allocator"
    assert plugin.vllm_port_allocator(PlatformDescription("cuda", "cuda", 100, "nccl")) is None


def test_host_allocator_reports_meminfo_and_accounts():
    alloc = plugin.host_allocator(str(DATA / "meminfo.txt"))
    assert alloc.mem_info() == (250000000 * 1024, 263741712 * 1024)
    buf = alloc.allocate(1 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 1 << 20
    alloc.free(buf)
    assert alloc.stats().allocated == 0 and alloc.stats().peak == 1 << 20
