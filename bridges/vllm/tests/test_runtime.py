"""The bridge's runtime refuses, at start and by name, a broken plugin or a kernel that fails its smoke check (no vLLM needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from vllm_port.ops import provider
from vllm_port_conformance.certify import digest, source_digest
from vllm_port_vllm import runtime
from vllm_port_vllm.certificate import CERTIFICATE_ENV
from vllm_port_vllm.errors import BridgeError

REPORT = Path(__file__).resolve().parents[3] / "docs" / "certification" / "cpu" / "report.json"


@pytest.fixture
def certified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CPU certificate of the sources installed here, named by VLLM_PORT_CERTIFICATE."""
    report = json.loads(REPORT.read_text())
    report["source"] = {**report["source"], **source_digest(report["source"]["packages"])}
    report["digest"] = digest(report)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    monkeypatch.setenv(CERTIFICATE_ENV, str(path))
    monkeypatch.setenv("VLLM_PORT_PLUGINS", "cpu")
    runtime.reset()
    yield path
    runtime.reset()


def _install(site: Path, name: str, source: str) -> None:
    (site / f"vllm_port_test_{name}.py").write_text(source)
    info = site / f"vllm_port_test_{name}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-port-test-{name}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[vllm_port]\n{name} = vllm_port_test_{name}\n")


def test_a_certified_plugin_binds_every_bridged_op_to_its_own_provider(certified: Path) -> None:
    b = runtime.bridge()
    assert b.plugin == "cpu"
    kernels = b.kernels(torch.float32)
    assert {kernels.providers[op].plugin for op in runtime.BRIDGED_OPS} == {"cpu"}


def test_a_plugin_that_fails_to_load_stops_the_bridge_by_name(
    certified: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "broken", "raise ImportError('libvendor.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("VLLM_PORT_PLUGINS")
    try:
        with pytest.raises(BridgeError, match=r"(?s)plugin is broken.*'broken'.*libvendor\.so"):
            runtime.bridge()
    finally:
        sys.modules.pop("vllm_port_test_broken", None)


@pytest.mark.slow
def test_a_kernel_that_fails_its_smoke_check_stops_the_bridge_by_name(
    certified: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = runtime.bridge()

    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # the right shape, the wrong values
        return torch.zeros_like(x[..., : x.shape[-1] // 2])

    wrong = provider("silu_and_mul", name="wrong_silu_and_mul", priority=99)(silu_and_mul)
    b.runtime.registry.register(wrong, plugin="cpu", platform="cpu")
    with pytest.raises(BridgeError, match=r"(?s)plugin 'cpu' cannot serve torch.float32 in vLLM: .*wrong_silu_and_mul"):
        b.kernels(torch.float32)


@pytest.mark.slow
def test_the_platform_plugin_leaves_a_device_vllm_knows_to_vllm(certified: Path) -> None:
    from vllm_port_vllm import platform

    assert runtime.bridge().runtime.platform.device_type == "cpu"
    assert platform.activate() is None  # vLLM's CPU platform stays; the general plugin swaps the kernels


def test_a_failing_provider_of_an_op_vllm_runs_itself_does_not_stop_the_bridge(certified: Path) -> None:
    b = runtime.bridge()

    def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int):
        raise RuntimeError("broken")

    broken = provider("top_logprobs", name="broken_top_logprobs", priority=99)(top_logprobs)
    b.runtime.registry.register(broken, plugin="cpu", platform="cpu")
    kernels = b.kernels(torch.float32)  # vLLM samples with its own sampler: not the bridge's to check or refuse
    assert {kernels.providers[op].plugin for op in runtime.BRIDGED_OPS} == {"cpu"}
