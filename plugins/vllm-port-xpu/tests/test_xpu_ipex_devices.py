"""The XPU plugin's optional IPEX providers, the IPEX/torch version rule, and device properties to capabilities.

No Intel GPU and no IPEX here: the adapters run against a stand-in ``ipex.llm.functional`` whose
functions compute what IPEX documents, and the device properties are values torch reports on real boards.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from vllm_port.ops import ALL_OPS, OpRegistry
from vllm_port.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from vllm_port.ops.rotary import make_cos_sin_cache, rotary_embedding_reference
from vllm_port.platform import validate_probe
from vllm_port_xpu import ipex_ops, plugin
from vllm_port_xpu.platform import device_capabilities, gpu_family, probe

GIB = 2**30

#: torch.xpu.get_device_properties(0) of a Data Center GPU Max 1100, as recorded in a torch inductor log
#: (driver 1.6.32567+18).
MAX_1100 = SimpleNamespace(
    name="Intel(R) Data Center GPU Max 1100", total_memory=51539607552, max_compute_units=448, gpu_eu_count=448,
    gpu_subslice_count=56, sub_group_sizes=[16, 32], has_fp16=True, has_fp64=True, has_bfloat16_conversions=True,
    has_subgroup_matrix_multiply_accumulate=True, max_work_group_size=1024,
)  # fmt: skip
#: A Data Center GPU Max 1550 in FLAT mode (one device per stack), from Intel's specification: 128 Xe-cores
#: (1024 EUs) and 128 GB HBM2e over two stacks; the same Xe-HPC feature set as the 1100 above.
MAX_1550 = SimpleNamespace(
    name="Intel(R) Data Center GPU Max 1550", total_memory=64 * GIB, max_compute_units=512, gpu_eu_count=512,
    gpu_subslice_count=64, sub_group_sizes=[16, 32], has_fp16=True, has_fp64=True, has_bfloat16_conversions=True,
    has_subgroup_matrix_multiply_accumulate=True, max_work_group_size=1024,
)  # fmt: skip
#: torch.xpu.get_device_properties(0) of an Arc A770 16 GB, as recorded (driver 1.13.35227): no fp64, and this
#: driver reports neither bf16 conversions nor the DPAS (XMX) extension.
ARC_A770 = SimpleNamespace(
    name="Intel(R) Arc(TM) A770 Graphics", total_memory=16704737280, max_compute_units=512, gpu_eu_count=512,
    sub_group_sizes=[8, 16, 32], has_fp16=True, has_fp64=False, has_bfloat16_conversions=False,
    has_subgroup_matrix_multiply_accumulate=False, max_work_group_size=1024,
)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# The IPEX / torch version rule
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ipex", "torch_version"),
    [("2.8.0+xpu", "2.8.0"), ("2.8.10+xpu", "2.8.0+xpu"), ("2.13.0", "2.13.1+xpu"), ("2.13.0.dev20260101", "2.13.0")],
)
def test_versions_match_on_major_minor(ipex: str, torch_version: str) -> None:
    assert ipex_ops.version_mismatch(ipex, torch_version) is None


def test_version_mismatch_says_what_to_install() -> None:
    assert ipex_ops.version_mismatch("2.8.0", "2.13.0") == (
        "2.8.0 does not match torch 2.13.0; install intel-extension-for-pytorch==2.13.* "
        "(IPEX is built for one torch minor release), or torch==2.8.* to keep this IPEX"
    )
    assert ipex_ops.version_mismatch("2.8.10+xpu", "2.1.0+cpu").startswith(
        "2.8.10+xpu does not match torch 2.1.0+cpu; install intel-extension-for-pytorch==2.1.*"
    )
    assert ipex_ops.major_minor("2.13.0a0+git1234") == (2, 13)
    assert "not a version" in str(ipex_ops.version_mismatch("unknown", "2.13.0"))


def test_mismatched_ipex_registers_nothing_and_the_probe_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipex_ops, "installed_version", lambda: "2.8.10+xpu")
    monkeypatch.setattr(torch, "__version__", "2.13.0+xpu")
    assert ipex_ops.providers() == []
    assert ipex_ops.status.startswith("2.8.10+xpu does not match torch 2.13.0+xpu; install ")
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    assert validate_probe(probe()).capabilities["ipex"] == ipex_ops.status


def test_without_ipex_no_providers_and_no_error() -> None:
    assert ipex_ops.installed_version() is None  # not installed here
    assert ipex_ops.providers() == []
    assert ipex_ops.status == "not installed (pip install vllm-port-xpu[ipex])"
    assert not any(p.name.startswith("ipex_") for p in plugin.vllm_port_providers())
    assert "intel_extension_for_pytorch" not in sys.modules


def fake_ipex(calls: list[str]) -> types.ModuleType:
    """A stand-in for ``intel_extension_for_pytorch`` whose ``llm.functional`` computes what IPEX documents."""

    def rms_norm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append("rms_norm")
        return rms_norm_reference(hidden_states, weight, eps)

    def add_rms_norm(residual, x, weight, bias, eps, add_back):
        calls.append("add_rms_norm")
        assert bias is None and add_back is True
        residual.add_(x)
        return rms_norm_reference(residual, weight, eps)

    def rotary_embedding(query, key, sin, cos, rotary_dim, rotary_half, position_ids=None):
        calls.append("rotary_embedding")
        assert sin.shape == (query.shape[0], 1, rotary_dim) == cos.shape
        out = []
        for t in (query, key):
            if rotary_half:
                rotated = torch.cat([-t[..., rotary_dim // 2 :], t[..., : rotary_dim // 2]], dim=-1)
            else:
                rotated = torch.stack([-t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
            out.append(t * cos + rotated * sin)  # new tensors: the adapter must copy them back
        return out[0], out[1]

    functional = SimpleNamespace(rms_norm=rms_norm, add_rms_norm=add_rms_norm, rotary_embedding=rotary_embedding)
    module = types.ModuleType("intel_extension_for_pytorch")
    module.llm = SimpleNamespace(functional=functional)  # type: ignore[attr-defined]
    return module


def test_matching_ipex_registers_providers_with_the_reference_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ipex_ops, "installed_version", lambda: "2.13.10+xpu")
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", fake_ipex([]))
    found = ipex_ops.providers()
    assert ipex_ops.status == "2.13.10+xpu"
    registry = OpRegistry(ALL_OPS)
    registered = [registry.register(p, plugin="xpu", platform="xpu") for p in found]
    assert [(p.op, p.name, p.priority) for p in registered] == [
        ("rms_norm", "ipex_rms_norm", 30),
        ("fused_add_rms_norm", "ipex_fused_add_rms_norm", 30),
        ("rotary_embedding", "ipex_rotary_embedding", 30),
    ]
    assert registry.candidates("rotary_embedding", "xpu")[0].name == "ipex_rotary_embedding"


def test_ipex_adapters_keep_the_contract() -> None:
    calls: list[str] = []
    kernels = ipex_ops.IpexKernels(fake_ipex(calls).llm.functional)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    residual = torch.randn(5, 64, generator=gen)
    expected_residual = residual.clone()
    expected = fused_add_rms_norm_reference(x, expected_residual, w, 1e-6)
    torch.testing.assert_close(kernels.fused_add_rms_norm(x, residual, w, 1e-6), expected)
    torch.testing.assert_close(residual, expected_residual)
    for neox, rot in ((True, 64), (False, 64), (True, 32), (False, 16)):
        positions = torch.randint(0, 256, (5,), generator=gen)
        q, k = torch.randn(5, 4 * 64, generator=gen), torch.randn(5, 2, 64, generator=gen)
        q_ref, k_ref = q.clone(), k.clone()
        cache = make_cos_sin_cache(256, rot)
        rotary_embedding_reference(positions, q_ref, k_ref, 64, cache, neox)
        assert kernels.rotary_embedding(positions, q, k, 64, cache, neox) is None
        torch.testing.assert_close(q, q_ref)
        torch.testing.assert_close(k, k_ref)
    assert calls == ["rms_norm", "add_rms_norm"] + ["rotary_embedding"] * 4
    with pytest.raises(Exception, match="rotary_embedding: is_neox"):  # the op's check runs before IPEX
        kernels.rotary_embedding(positions, q, k, 64, cache, 1)  # type: ignore[arg-type]
    assert len(calls) == 6


# ------------------------------------------------------------------------------------------------
# Device properties -> capabilities
# ------------------------------------------------------------------------------------------------


def test_capabilities_of_a_data_center_gpu_max() -> None:
    assert device_capabilities(MAX_1550) == {
        "device_name": "Intel(R) Data Center GPU Max 1550", "gpu_family": "xe-hpc", "total_memory": 64 * GIB,
        "compute_units": 512, "sub_group_sizes": ["16", "32"], "max_sub_group_size": 32, "fp64": True,
        "fp16": True, "bf16_conversions": True, "xmx": True,
    }  # fmt: skip
    assert device_capabilities(MAX_1100)["total_memory"] == 48 * GIB


def test_capabilities_of_an_arc_a770() -> None:
    assert device_capabilities(ARC_A770) == {
        "device_name": "Intel(R) Arc(TM) A770 Graphics", "gpu_family": "xe-hpg", "total_memory": 16704737280,
        "compute_units": 512, "sub_group_sizes": ["8", "16", "32"], "max_sub_group_size": 32, "fp64": False,
        "fp16": True, "bf16_conversions": False, "xmx": False,
    }  # fmt: skip
    assert gpu_family("Intel(R) Arc(TM) B580 Graphics") == "xe2-hpg"
    assert gpu_family("Intel(R) UHD Graphics 770") == "unknown"
    # a torch release without the newer fields still maps
    bare = SimpleNamespace(name="Intel(R) Arc(TM) A770 Graphics", total_memory=1, max_compute_units=1, has_fp64=False)
    assert device_capabilities(bare)["sub_group_sizes"] == [] and device_capabilities(bare)["xmx"] is False


def test_probe_uses_device_properties_when_it_can_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    result = validate_probe(probe(read_properties=lambda i: MAX_1550))
    assert [(d.name, d.total_memory, d.arch) for d in result.devices] == [
        ("Intel(R) Data Center GPU Max 1550", 64 * GIB, "xe-hpc")
    ] * 2
    assert result.capabilities["max_sub_group_size"] == 32 and result.capabilities["fp64"] is True
    assert result.capabilities["ipex"] == "not installed (pip install vllm-port-xpu[ipex])"
    assert result.reason == (
        f"2 Intel GPU(s) visible to torch {torch.__version__} (XPU 20250101): 2x Intel(R) Data Center GPU Max 1550"
    )
    # without a context (here: none exists) it reads nothing, so that it creates none
    assert validate_probe(probe()).devices[0].name == "Intel GPU 0"
