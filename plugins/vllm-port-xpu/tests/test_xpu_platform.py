"""The XPU plugin: description and a probe that stays cheap and says how to get an Intel GPU working."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_port import PlatformDescription
from vllm_port.platform import validate_description, validate_probe
from vllm_port.plugin_kit import DeviceAllocator
from vllm_port_xpu import plugin
from vllm_port_xpu.platform import describe, probe, xpu_build

NO_XPU_TORCH = xpu_build() is None


def test_describe_is_valid_and_names_xpu() -> None:
    d = validate_description(describe())
    assert (d.name, d.device_type, d.priority, d.dist_backend) == ("xpu", "xpu", 90, "xccl")
    assert d.graph_capture is False
    assert d.memory_tiers == ("device", "pinned_host")


@pytest.mark.skipif(not NO_XPU_TORCH, reason="asserts the reason a torch build without XPU gives")
def test_probe_without_xpu_torch_says_how_to_fix() -> None:
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason == (
        f"torch {torch.__version__} has no XPU support (torch.version.xpu is None); "
        "install torch's XPU build (pip install torch --index-url https://download.pytorch.org/whl/xpu)"
    )
    assert result.devices == ()


@pytest.mark.slow
def test_probe_creates_no_device_context() -> None:
    code = textwrap.dedent("""
        import torch
        from vllm_port.platform import validate_probe
        from vllm_port_xpu import plugin
        validate_probe(plugin.vllm_port_platform_probe())
        print(torch.xpu.is_initialized(), torch.cuda.is_initialized(), plugin.vllm_port_platform_context_created())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


def test_probe_on_xpu_torch_without_gpu_names_the_selector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 0)
    monkeypatch.delenv("ONEAPI_DEVICE_SELECTOR", raising=False)
    monkeypatch.setenv("ZE_AFFINITY_MASK", "3")
    result = validate_probe(probe())
    assert result.available is False
    assert result.reason == (
        f"torch {torch.__version__} (XPU 20250101) sees no Intel GPU; "
        "set ZE_AFFINITY_MASK='3' to GPUs that sycl-ls lists, or unset it"
    )
    monkeypatch.delenv("ZE_AFFINITY_MASK")
    assert "install Intel's GPU driver with its Level Zero loader" in probe().reason


def test_probe_with_gpus_lists_them_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    result = validate_probe(probe())
    assert result.available is True
    assert [(d.name, d.total_memory) for d in result.devices] == [("Intel GPU 0", 0), ("Intel GPU 1", 0)]
    assert result.capabilities["xpu_version"] == "20250101"
    assert isinstance(result.capabilities["ipex_installed"], bool)
    assert result.reason.startswith(f"2 Intel GPU(s) visible to torch {torch.__version__} (XPU 20250101); ")
    assert "read at bind" in result.reason


def test_allocator_only_for_the_xpu_platform() -> None:
    before = torch.xpu.is_initialized()
    allocator = plugin.vllm_port_allocator(describe())
    assert type(allocator) is DeviceAllocator and allocator.name == "xpu allocator"
    assert allocator.device.type == "xpu" and allocator.torch_device == "xpu"
    assert plugin.vllm_port_allocator(PlatformDescription("cuda", "cuda", 100, "nccl")) is None
    assert torch.xpu.is_initialized() == before  # building it touches no device


@pytest.mark.slow
def test_the_triton_target_is_plain_data_that_imports_without_triton() -> None:
    # Triton is no declared dependency (torch's XPU wheels bring it): the plugin's modules import without it.
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # makes ``import triton`` raise ImportError
        from vllm_port_xpu.triton_targets import XPU
        print(XPU.name)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["xpu"]
