"""The CPU plugin: probe against recorded /proc files and the host allocator (providers: test_cpu_ops.py)."""

from pathlib import Path

import torch

from vllm_port.platform import validate_description, validate_probe
from vllm_port_cpu import platform
from vllm_port_cpu.memory import HostAllocator

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


def test_host_allocator_reports_meminfo_and_accounts():
    alloc = HostAllocator(str(DATA / "meminfo.txt"))
    assert alloc.mem_info() == (250000000 * 1024, 263741712 * 1024)
    buf = alloc.allocate(1 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 1 << 20
    alloc.free(buf)
    assert alloc.stats().allocated == 0 and alloc.stats().peak == 1 << 20
