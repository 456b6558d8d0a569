"""The CPU plugin: probe against recorded /proc files, the host allocator, and its providers."""

from pathlib import Path

import pytest
import torch

from vllm_port.ops import ALL_OPS, compare
from vllm_port.platform import validate_description, validate_probe
from vllm_port_cpu import ops, platform
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


@pytest.mark.parametrize("provider", ops.PROVIDERS, ids=lambda p: p.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_providers_match_the_float64_reference_on_strided_inputs(provider, dtype):
    op = next(o for o in ALL_OPS if o.name == provider.op)
    gen = torch.Generator().manual_seed(3)
    for sample in op.samples(dtype, torch.device("cpu"), gen):
        # a column slice of a wider tensor: same values, non-contiguous rows
        strided = tuple(
            torch.cat([a, a], dim=-1)[..., : a.shape[-1]] if isinstance(a, torch.Tensor) and a.dim() > 1 else a
            for a in sample.args
        )
        assert strided[0].stride(0) == 2 * strided[0].shape[-1]
        assert compare(op, strided, provider.fn(*strided), dtype) is None, sample.label
