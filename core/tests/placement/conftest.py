"""Fixtures of the placement tests: a second CPU platform ``cpu-b`` installed for real, and a tiny Llama.

``cpu-b`` is a test plugin whose platform is also the host CPU and whose providers are the CPU
plugin's kernels under its own names, so a model placed over ``cpu`` and ``cpu-b`` must give the
unplaced model's logits bit for bit, while every transfer between them still copies. Its probe finds
two devices, so ``cpu-b:1`` stands for a second GPU in pipeline placements.
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

    @hookimpl
    def vllm_port_platform_probe():  # two devices: cpu-b:1 is a second one (both the host, really)
        devices = (DeviceInfo("test device 0", 1 << 30, "test"), DeviceInfo("test device 1", 1 << 30, "test"))
        return ProbeResult(True, "two test devices that are always there", devices)
    """,
)

#: Seconds the ``cpu-jit`` platform's decode attention spends the first time it meets a batch size.
JIT_SECONDS = 0.5  # far above a loaded CI machine's noise in a tiny model's step

#: A platform like the CUDA one where the bench met trouble: ``cpu-b``'s providers, but KV blocks of 128
#: tokens (CUDA's), and a decode attention that "compiles" (sleeps ``JIT_SECONDS``) the first time it sees
#: a number of sequences, as Triton specialises kernels on sizes.
CPU_JIT = healthy(
    "cpu-jit",
    0,
    extra=f"""
    @hookimpl
    def vllm_port_platform_describe():
        return PlatformDescription(name=PLATFORM, device_type="cpu", priority=PRIORITY, dist_backend="gloo",
                                   kv_block_size=128)

    import dataclasses
    import functools
    import time
    from vllm_port_cpu.ops import PROVIDERS

    _SEEN = set()

    def _compiles_per_batch(fn):
        @functools.wraps(fn)
        def paged_attention(query, *args, **kwargs):
            if query.shape[0] not in _SEEN:
                _SEEN.add(query.shape[0])
                time.sleep({JIT_SECONDS})
            return fn(query, *args, **kwargs)

        return paged_attention

    @hookimpl
    def vllm_port_providers():
        return [
            dataclasses.replace(
                p,
                platform="cpu-jit",
                name="jit_" + p.name,
                fn=_compiles_per_batch(p.fn) if p.op == "paged_attention" else p.fn,
            )
            for p in PROVIDERS
        ]
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
def cpu_jit(install_plugin: Callable[..., str]) -> float:
    """The ``cpu-jit`` test platform installed; returns the seconds its decode attention "compiles" per batch size."""
    install_plugin("cpu-jit", CPU_JIT)
    return JIT_SECONDS


@pytest.fixture
def llama(llama_dir: Path):
    """The tiny Llama loaded in host memory, float32."""
    import torch

    from vllm_port.models import load_model

    return load_model(llama_dir, torch.device("cpu"), torch.float32)
