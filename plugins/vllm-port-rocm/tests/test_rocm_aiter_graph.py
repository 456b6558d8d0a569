"""The ROCm plugin's optional AITER providers and HIP graph capture, without AMD hardware or AITER.

The AITER adapters are run against a stand-in ``aiter`` module whose functions compute what AITER's
documented ones do (``rms_norm(input, weight, epsilon)``; ``rmsnorm2d_fwd_with_add(out, input,
residual_in, residual_out, weight, epsilon)``), so the argument order and the in-place contract are
checked; AITER's kernels themselves are not run here.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm_port import PlatformDescription
from vllm_port.ops import ALL_OPS, OpRegistry
from vllm_port.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from vllm_port_rocm import aiter_ops, plugin
from vllm_port_rocm.platform import describe


def fake_aiter(calls: list[str]) -> types.ModuleType:
    module = types.ModuleType("aiter")
    module.__version__ = "0.1.7"  # type: ignore[attr-defined]

    def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        assert input.dim() == 2
        calls.append("rms_norm")
        return rms_norm_reference(input, weight, epsilon)

    def rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon) -> None:
        calls.append("rmsnorm2d_fwd_with_add")
        residual_out.copy_(input + residual_in)
        out.copy_(rms_norm_reference(residual_out, weight, epsilon))

    module.rms_norm = rms_norm  # type: ignore[attr-defined]
    module.rmsnorm2d_fwd_with_add = rmsnorm2d_fwd_with_add  # type: ignore[attr-defined]
    return module


def test_without_aiter_no_providers_and_no_error() -> None:
    # Here torch is a CPU build and aiter is not installed: the plugin loads, AITER adds nothing.
    assert aiter_ops.providers() == []
    assert aiter_ops.status.startswith("not used: torch")
    names = {p.name for p in plugin.vllm_port_providers()}
    assert "triton_rms_norm" in names and not any(n.startswith("aiter_") for n in names)


def test_aiter_guard_on_a_rocm_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setitem(sys.modules, "aiter", None)  # makes `import aiter` raise ImportError
    assert aiter_ops.providers() == []
    assert aiter_ops.status == "not installed (pip install vllm-port-rocm[aiter])"
    unrelated = types.ModuleType("aiter")  # PyPI's "aiter" is an async-iterator library
    monkeypatch.setitem(sys.modules, "aiter", unrelated)
    assert aiter_ops.providers() == []
    assert aiter_ops.status == "aiter unknown version lacks rms_norm, rmsnorm2d_fwd_with_add; upgrade aiter"


def test_aiter_providers_register_with_the_reference_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setitem(sys.modules, "aiter", fake_aiter([]))
    found = aiter_ops.providers()
    assert aiter_ops.status == "aiter 0.1.7"
    registry = OpRegistry(ALL_OPS)
    registered = [registry.register(p, plugin="rocm", platform="rocm") for p in found]
    assert [(p.op, p.name, p.priority) for p in registered] == [
        ("rms_norm", "aiter_rms_norm", 30),
        ("fused_add_rms_norm", "aiter_fused_add_rms_norm", 30),
    ]
    assert registry.candidates("rms_norm", "rocm")[0].name == "aiter_rms_norm"


def test_aiter_adapters_keep_the_contract() -> None:
    calls: list[str] = []
    kernels = aiter_ops.AiterKernels(fake_aiter(calls))
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 64, generator=gen), torch.randn(64, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    residual = torch.randn(2, 3, 64, generator=gen)
    expected_residual = residual.clone()
    expected = fused_add_rms_norm_reference(x, expected_residual, w, 1e-6)
    torch.testing.assert_close(kernels.fused_add_rms_norm(x, residual, w, 1e-6), expected)
    torch.testing.assert_close(residual, expected_residual)  # the sum is written back in place
    assert calls == ["rms_norm", "rmsnorm2d_fwd_with_add"]
    with pytest.raises(Exception, match="rms_norm: epsilon"):  # the op's check runs before AITER
        kernels.rms_norm(x, w, -1.0)
    assert calls == ["rms_norm", "rmsnorm2d_fwd_with_add"]


def test_graph_capture_only_for_the_rocm_platform() -> None:
    assert plugin.vllm_port_graph_capture(PlatformDescription("cuda", "cuda", 100, "nccl")) is None
    assert describe().graph_capture is True


def test_hip_graph_capture_captures_then_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda's graph API, recorded: the order of HIP graph capture as the plugin drives it.
    events: list[str] = []

    class Stream:
        def wait_stream(self, other: object) -> None:
            events.append("wait")

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    class Ctx:
        def __init__(self, label: str) -> None:
            self.label = label

        def __enter__(self) -> None:
            events.append(f"enter {self.label}")

        def __exit__(self, *exc: object) -> None:
            events.append(f"exit {self.label}")

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: Ctx("side stream"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool: Ctx(f"capture pool={pool}"))
    capture = plugin.vllm_port_graph_capture(describe())
    assert capture is not None and capture.name == "hip graphs"
    out = torch.zeros(1)

    def step() -> torch.Tensor:
        events.append("step")
        return out

    replay = capture.capture(step, warmup=2)
    assert replay() is out
    assert events == [
        "wait", "enter side stream", "step", "step", "exit side stream", "wait",
        "enter capture pool=pool", "step", "exit capture pool=pool", "replay",
    ]  # fmt: skip
