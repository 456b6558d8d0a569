"""The shared kernels' device properties come from the selected platform, with torch as the fallback."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from vllm_port import DeviceInfo, device_properties
from vllm_port.device_properties import compute_units, publish


@pytest.fixture(autouse=True)
def clean_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with nothing published and nothing cached, and leaves it so."""
    monkeypatch.setattr(device_properties, "_published", {})
    monkeypatch.setattr(device_properties, "_cache", {})
    yield


def _torch_never_asked(device: object) -> object:
    raise AssertionError(f"torch was asked for {device}'s properties although the platform answered")


def test_the_platform_answers_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", _torch_never_asked)
    publish("cuda", [DeviceInfo("AMD Instinct MI300X", arch="gfx942", compute_units=304), DeviceInfo("gpu 1")])
    assert compute_units(torch.device("cuda", 0), default=4) == 304
    assert compute_units(torch.device("cuda"), default=4) == 304  # no index: device 0


def test_torch_answers_what_the_probe_could_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def h200(device: object) -> SimpleNamespace:
        asked.append(device)
        return SimpleNamespace(name="NVIDIA H200", multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", h200)
    publish("cuda", [DeviceInfo("NVIDIA H200", 150754820096, "sm_90"), DeviceInfo("NVIDIA H200")])
    assert compute_units(torch.device("cuda", 1), default=4) == 132
    assert compute_units(torch.device("cuda", 1), default=4) == 132
    assert asked == [torch.device("cuda", 1)]  # read once, then cached


def test_intel_xe_cores_and_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda d: SimpleNamespace(gpu_subslice_count=56))
    assert compute_units(torch.device("xpu", 0), default=4) == 56
    assert compute_units(torch.device("cpu"), default=4) == 4  # Triton's interpreter: the caller's default


def test_publishing_again_replaces_the_cached_answer() -> None:
    publish("cuda", [DeviceInfo("gpu", compute_units=80)])
    assert compute_units(torch.device("cuda", 0), default=4) == 80
    publish("cuda", [DeviceInfo("gpu", compute_units=120)])
    assert compute_units(torch.device("cuda", 0), default=4) == 120


def test_the_shared_triton_kernels_ask_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_port.kernels.triton import attention, sampling

    monkeypatch.setattr(torch.cuda, "get_device_properties", _torch_never_asked)
    publish("cuda", [DeviceInfo("AMD Instinct MI300X", compute_units=304)])
    assert attention._num_sms(torch.device("cuda", 0)) == sampling._num_sms(torch.device("cuda", 0)) == 304
    assert attention._num_sms(torch.device("cpu")) == 4


def test_the_runtime_publishes_the_selected_platforms_devices() -> None:
    import vllm_port

    runtime = vllm_port.load(plugins="cpu")
    assert device_properties._published["cpu"] == runtime.selected.probe.devices  # type: ignore[union-attr]
