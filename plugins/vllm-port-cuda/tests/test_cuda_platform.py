"""The CUDA plugin: description, a probe that stays cheap, NVML parsing and compute-capability features.

The probe tests read this machine as it is (a CPU build of torch asserts the exact reason); NVML is
replaced by a fake module holding values an H200 host reported, so the parsing runs without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from vllm_port import PlatformDescription
from vllm_port.platform import validate_description, validate_probe
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture
from vllm_port_cuda import plugin
from vllm_port_cuda.platform import capabilities, describe, parse_visible_devices, probe, read_nvml

CPU_TORCH = torch.version.cuda is None and torch.version.hip is None
#: nvidia-smi on an H200 host: 143771 MiB, driver 580.159.03, compute capability 9.0.
H200 = ("NVIDIA H200", 143771 * 2**20, (9, 0))


def test_describe_is_valid_and_names_cuda() -> None:
    d = validate_description(describe())
    assert (d.name, d.device_type, d.priority, d.dist_backend) == ("cuda", "cuda", 100, "nccl")
    assert d.graph_capture is True
    assert d.memory_tiers == ("device", "pinned_host")


@pytest.mark.skipif(not CPU_TORCH, reason="asserts the reason a CPU build of torch gives")
def test_probe_on_cpu_torch_says_how_to_fix() -> None:
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason == (
        f"torch {torch.__version__} has no CUDA support (torch.version.cuda is None); install a CUDA build of torch"
    )
    assert result.devices == ()


@pytest.mark.slow
def test_probe_creates_no_cuda_context() -> None:
    # A fresh interpreter, so that nothing else in this test session can have initialised CUDA first.
    code = textwrap.dedent("""
        import torch
        from vllm_port.platform import validate_probe
        from vllm_port_cuda import plugin
        validate_probe(plugin.vllm_port_platform_probe())
        print(torch.cuda.is_initialized(), plugin.vllm_port_platform_context_created())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_probe_on_rocm_torch_points_to_the_rocm_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    result = validate_probe(probe())
    assert result.available is False
    assert "is a ROCm (HIP 6.4.43482) build" in result.reason
    assert "vllm-port-rocm" in result.reason


def test_probe_without_visible_gpu_names_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason == (
        f"torch {torch.__version__} (CUDA 12.8) sees no NVIDIA GPU with CUDA_VISIBLE_DEVICES=''; "
        "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs that nvidia-smi -L lists, or unset it"
    )


@pytest.mark.parametrize(
    ("gpu", "cc", "features"),
    [
        ("T4", (7, 5), set()),
        ("A100", (8, 0), {"bf16"}),
        ("L40S", (8, 9), {"bf16", "fp8"}),
        ("H100, H200", (9, 0), {"bf16", "fp8", "tma", "wgmma"}),
        ("B200", (10, 0), {"bf16", "fp8", "tma", "fp4"}),
    ],
)
def test_capabilities_follow_compute_capability(gpu: str, cc: tuple[int, int], features: set[str]) -> None:
    caps = capabilities(*cc)
    assert caps["compute_capability"] == f"{cc[0]}.{cc[1]}"
    assert caps["arch"] == f"sm_{cc[0]}{cc[1]}"
    assert {name for name, value in caps.items() if value is True} == features, gpu


def test_parse_visible_devices_stops_at_the_first_invalid_entry() -> None:
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices("1, 0") == ["1", "0"]
    assert parse_visible_devices("0,-1,1") == ["0"]
    assert parse_visible_devices("GPU-8d3f,MIG-1a2b") == ["GPU-8d3f", "MIG-1a2b"]


def fake_nvml(*gpus: tuple[str, int, tuple[int, int]]) -> SimpleNamespace:
    """A stand-in for the pynvml module, answering for ``gpus`` (name, bytes, compute capability)."""

    class NVMLError(Exception):
        pass

    def by_index(i: int) -> int:
        if i >= len(gpus):
            raise NVMLError("Invalid Argument")
        return i

    return SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: "580.159.03",
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetHandleByUUID=lambda uuid: by_index(int(uuid.rsplit("-", 1)[1])),
        nvmlDeviceGetName=lambda h: gpus[h][0].encode(),  # old bindings answer bytes
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=gpus[h][1], free=gpus[h][1], used=0),
        nvmlDeviceGetCudaComputeCapability=lambda h: gpus[h][2],
    )


def test_read_nvml_follows_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(("NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0)), H200))
    devices, driver = read_nvml(["1", "0"]) or ([], "")
    assert [(d.name, d.compute_capability) for d in devices] == [
        ("NVIDIA H200", (9, 0)),
        ("NVIDIA A100-SXM4-80GB", (8, 0)),
    ]
    assert driver == "580.159.03"
    devices, _ = read_nvml(["GPU-1", "MIG-0", "0"]) or ([], "")
    assert [d.name for d in devices] == ["NVIDIA H200"]  # stops at the MIG instance
    assert len((read_nvml(None) or ([], ""))[0]) == 2


def test_read_nvml_without_a_driver_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml()

    def no_driver() -> None:
        raise nvml.NVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert read_nvml(None) is None


def test_probe_with_a_gpu_reads_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(H200))
    result = validate_probe(probe())
    assert result.available is True
    assert [(d.name, d.total_memory, d.arch) for d in result.devices] == [("NVIDIA H200", 150754820096, "sm_90")]
    assert result.capabilities["compute_capability"] == "9.0"
    assert result.capabilities["wgmma"] is True
    assert result.capabilities["driver_version"] == "580.159.03"
    assert result.capabilities["cuda_runtime"] == "13.0"
    assert (
        result.reason
        == f"1 NVIDIA GPU(s) visible to torch {torch.__version__} (CUDA 13.0): 1x NVIDIA H200, driver 580.159.03"
    )


def test_probe_without_nvml_names_devices_generically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes ``import pynvml`` raise ImportError
    result = validate_probe(probe())
    assert result.available is True
    assert [(d.name, d.total_memory) for d in result.devices] == [("NVIDIA GPU 0", 0), ("NVIDIA GPU 1", 0)]
    assert "read at bind" in result.reason
    assert "compute_capability" not in result.capabilities


def test_allocator_only_for_the_cuda_platform() -> None:
    before = torch.cuda.is_initialized()
    allocator = plugin.vllm_port_allocator(describe())
    assert type(allocator) is DeviceAllocator and allocator.name == "cuda allocator"
    assert allocator.device.type == "cuda" and allocator.torch_device == "cuda"
    assert plugin.vllm_port_allocator(PlatformDescription("rocm", "cuda", 100, "nccl")) is None
    assert torch.cuda.is_initialized() == before  # building it touches no device


def test_graph_capture_is_cuda_graphs_through_the_kit_for_the_cuda_platform_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")  # so it builds on a machine without CUDA
    capture = plugin.vllm_port_graph_capture(describe())
    assert type(capture) is StreamGraphCapture and capture.name == "cuda graphs"
    assert (capture.torch_device, capture.graph_type, capture.pool) == ("cuda", "CUDAGraph", "pool")
    assert plugin.vllm_port_graph_capture(PlatformDescription("rocm", "cuda", 100, "nccl")) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_allocator_allocates_on_the_gpu() -> None:
    allocator = plugin.vllm_port_allocator(describe())
    free, total = allocator.mem_info()
    assert 0 < free <= total
    buffer = allocator.allocate(1 << 20)
    assert buffer.device.type == "cuda"
    assert buffer.numel() == 1 << 20
    assert allocator.stats().allocated == 1 << 20
    allocator.free(buffer)
    assert allocator.stats().live_buffers == 0
