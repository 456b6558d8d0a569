"""Fixtures of the fault tests: broken plugins installed for real (``faulty_plugins.py``), a clean quarantine,
and no strict or debug mode leaking in from the environment."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from faulty_plugins import adapter

import vllm_port
from vllm_port.ops.debug import clear_quarantine


@pytest.fixture(autouse=True)
def clean_modes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with no provider quarantined and strict and debug mode off."""
    for name in ("VLLM_PORT_STRICT", "VLLM_PORT_CHECK", "VLLM_PORT_CHECK_DIR", "VLLM_PORT_CHECK_SEED"):
        monkeypatch.delenv(name, raising=False)
    clear_quarantine()
    yield
    clear_quarantine()


@pytest.fixture
def faulty_runtime(install_plugin: Callable[..., str]) -> Callable[..., vllm_port.Runtime]:
    """``faulty_runtime("raises", ...)``: the CPU platform with an adapter plugin ``zfaulty`` whose providers have those faults."""

    def make(*faults: str) -> vllm_port.Runtime:
        install_plugin("zfaulty", adapter(*faults))
        return vllm_port.load(plugins="cpu,zfaulty", device="cpu")

    return make
