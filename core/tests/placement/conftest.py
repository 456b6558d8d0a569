"""Fixtures of the placement tests: a second CPU platform ``cpu-b`` installed for real, and a tiny Llama.

``cpu-b`` is a test plugin whose platform is also the host CPU and whose providers are the CPU
plugin's kernels under its own names, so a model placed over ``cpu`` and ``cpu-b`` must give the
unplaced model's logits bit for bit, while every transfer between them still copies.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "flat"))

from plugin_factory import healthy

#: The second platform: the CPU plugin's providers, registered for platform ``cpu-b`` as ``b_<name>``.
CPU_B = healthy(
    "cpu-b",
    0,
    extra="""
    import dataclasses
    from vllm_port_cpu.ops import PROVIDERS

    @hookimpl
    def vllm_port_providers():
        return [dataclasses.replace(p, platform="cpu-b", name="b_" + p.name) for p in PROVIDERS]
    """,
)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama 3.1 checkpoint (2 layers, GQA) saved with ``transformers``."""
    pytest.importorskip("transformers")
    from tiny_models import save_tiny_model

    return save_tiny_model("llama", tmp_path_factory.mktemp("placement-llama"))


@pytest.fixture
def platforms(install_plugin: Callable[..., str]):
    """``cpu`` (the default) and ``cpu-b``, loaded together."""
    from vllm_port.placement import load_many

    install_plugin("cpu-b", CPU_B)
    return load_many(["cpu", "cpu-b"], plugins="cpu,cpu-b")


@pytest.fixture
def llama(llama_dir: Path):
    """The tiny Llama loaded in host memory, float32."""
    import torch

    from vllm_port.models import load_model

    return load_model(llama_dir, torch.device("cpu"), torch.float32)
