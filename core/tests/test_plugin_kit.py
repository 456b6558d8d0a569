"""The shared plugin parts: a device allocator, graph capture and the standard hooks, on fake torch modules."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

import vllm_port
from vllm_port import PlatformDescription, ProbeResult
from vllm_port.memory import HostMemoryAllocator, OutOfMemoryError
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture, platform_hooks, torch_device_module

MIB = 1 << 20


def fake_device_module(monkeypatch: pytest.MonkeyPatch, name: str, **functions: object) -> ModuleType:
    """A ``torch.<name>`` module holding ``functions``, gone again after the test."""
    module = ModuleType(f"torch.{name}")
    for attr, value in functions.items():
        setattr(module, attr, value)
    monkeypatch.setattr(torch, name, module, raising=False)
    return module


def test_device_allocator_counts_torch_cache_as_free(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[str] = []
    fake_device_module(
        monkeypatch,
        "fakegpu",
        mem_get_info=lambda device: (10 * MIB, 64 * MIB),
        memory_reserved=lambda device: 6 * MIB,
        memory_allocated=lambda device: 2 * MIB,
        empty_cache=lambda: emptied.append("empty"),
    )
    # buffers land on the CPU (the only device here); the accounting is the fake module's
    allocator = DeviceAllocator("fakegpu allocator", "cpu", torch_device="fakegpu")
    assert allocator.mem_info() == (14 * MIB, 64 * MIB)  # 10 free + 4 cached but unused
    buffer = allocator.allocate(MIB)
    assert (buffer.dtype, buffer.numel(), allocator.stats().allocated) == (torch.uint8, MIB, MIB)
    allocator.free(buffer)
    allocator.empty_cache()
    assert emptied == ["empty"]
    with pytest.raises(OutOfMemoryError, match=r"fakegpu allocator: cannot allocate 15,728,640 bytes"):
        allocator.allocate(15 * MIB)


def test_device_allocator_names_the_missing_torch_module() -> None:
    allocator = DeviceAllocator("nochip allocator", "cpu", torch_device="nochip")
    with pytest.raises(RuntimeError, match=r"has no torch\.nochip module; install a torch build with nochip support"):
        allocator.mem_info()
    assert torch_device_module("cpu") is torch.cpu


def test_stream_graph_capture_warms_up_on_a_side_stream_then_replays(monkeypatch: pytest.MonkeyPatch) -> None:
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

    fake_device_module(
        monkeypatch,
        "fakegpu",
        graph_pool_handle=lambda: "pool",
        Stream=Stream,
        current_stream=Stream,
        stream=lambda s: Ctx("side"),
        FakeGraph=Graph,
        graph=lambda g, pool: Ctx(f"capture {type(g).__name__} pool={pool}"),
    )
    capture = StreamGraphCapture("fake graphs", torch_device="fakegpu", graph_type="FakeGraph")
    out = torch.zeros(1)

    def step() -> torch.Tensor:
        events.append("step")
        return out

    replay = capture.capture(step, warmup=1)
    assert (capture.name, replay(), replay()) == ("fake graphs", out, out)
    assert events == [
        "wait", "enter side", "step", "exit side", "wait",
        "enter capture Graph pool=pool", "step", "exit capture Graph pool=pool", "replay", "replay",
    ]  # fmt: skip


def _hooks(**parts: Callable[..., object]) -> dict[str, Callable[..., object]]:
    return platform_hooks(
        api_range=">=1.0,<2",
        describe=lambda: PlatformDescription("mychip", "cpu", 5, "gloo"),
        probe=lambda: ProbeResult(True, "always here", (vllm_port.DeviceInfo("chip 0"),)),
        **parts,
    )


def test_platform_hooks_define_only_the_parts_given() -> None:
    assert sorted(_hooks()) == ["vllm_port_api_range", "vllm_port_platform_describe", "vllm_port_platform_probe"]
    full = _hooks(
        torch_device="nochip",
        providers=list,
        allocator=lambda: HostMemoryAllocator(pinned=False),
        graph_capture=object,
    )
    assert sorted(full) == sorted(
        [
            "vllm_port_api_range",
            "vllm_port_platform_describe",
            "vllm_port_platform_probe",
            "vllm_port_platform_context_created",
            "vllm_port_providers",
            "vllm_port_allocator",
            "vllm_port_graph_capture",
        ]
    )
    assert full["vllm_port_platform_context_created"]() is False  # no torch.nochip: no context either
    other = PlatformDescription("otherchip", "cpu", 5, "gloo")
    assert isinstance(full["vllm_port_allocator"](full["vllm_port_platform_describe"]()), HostMemoryAllocator)
    assert full["vllm_port_allocator"](other) is None  # answers for its own platform only
    assert full["vllm_port_graph_capture"](other) is None


def test_a_plugin_module_of_platform_hooks_is_discovered_and_bound(install_plugin: Callable[..., str]) -> None:
    # the real path: entry point, import, pluggy's check of every hook against the specs, the runtime's parts
    source = """
        from vllm_port import DeviceInfo, PlatformDescription, ProbeResult
        from vllm_port.memory import HostMemoryAllocator
        from vllm_port.plugin_kit import platform_hooks

        globals().update(
            platform_hooks(
                api_range=">=1.0,<2",
                describe=lambda: PlatformDescription("kitchip", "cpu", 5, "gloo"),
                probe=lambda: ProbeResult(True, "always here", (DeviceInfo("kit device", 1 << 30),)),
                torch_device="cpu",
                providers=list,
                allocator=lambda: HostMemoryAllocator(pinned=False, name="kit allocator"),
            )
        )
    """
    install_plugin("kitchip", source)
    runtime = vllm_port.load(plugins="kitchip")
    assert (runtime.platform.name, runtime.selected.error, runtime.selected.api_range) == ("kitchip", None, ">=1.0,<2")
    assert runtime.allocator().name == "kit allocator"
