"""The shared plugin parts: a device allocator, graph capture and the context check, on fake torch modules."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import ModuleType

import pytest
import torch

import vllm_port
from vllm_port.memory import OutOfMemoryError
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture, device_context_created, torch_device_module
from vllm_port.scaffold import new_plugin

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
    made: list[object] = []
    monkeypatch.setattr(StreamGraphCapture, "_warmup_streams", {})

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
        Stream=lambda: made.append(Stream()) or made[-1],  # the side streams the capture makes
        current_stream=Stream,
        current_device=lambda: 0,
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
    # every capture of the process, of this runner or the next engine's, warms up on that one side stream: cuBLAS
    # keeps a workspace for each stream it ran on, so a stream per capture left 1 GiB allocated on an H100
    StreamGraphCapture("next engine's graphs", torch_device="fakegpu", graph_type="FakeGraph").capture(step, warmup=1)
    capture.capture(step, warmup=1)
    assert len(made) == 1 and list(StreamGraphCapture._warmup_streams.values()) == made


def test_device_context_created_asks_the_device_module_and_is_false_without_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = iter([False, True])
    fake_device_module(monkeypatch, "fakegpu", is_initialized=lambda: next(answers))
    assert device_context_created("fakegpu") is False
    assert device_context_created("fakegpu") is True  # asked at each call, not once
    assert device_context_created("nochip") is False  # a torch build without torch.nochip made no context


def test_a_plugin_module_of_hooks_on_kit_parts_is_discovered_and_bound(install_plugin: Callable[..., str]) -> None:
    # the real path: entry point, import, pluggy's check of every hook against the specs, the runtime's parts
    source = """
        from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
        from vllm_port.memory import HostMemoryAllocator
        from vllm_port.plugin_kit import device_context_created

        @hookimpl
        def vllm_port_api_range():
            return ">=1.0,<2"

        @hookimpl
        def vllm_port_platform_describe():
            return PlatformDescription("kitchip", "cpu", 5, "gloo")

        @hookimpl
        def vllm_port_platform_probe():
            return ProbeResult(True, "always here", (DeviceInfo("kit device", 1 << 30),))

        @hookimpl
        def vllm_port_platform_context_created():
            return device_context_created("cpu")

        @hookimpl
        def vllm_port_providers():
            return []

        @hookimpl
        def vllm_port_allocator(platform):
            return HostMemoryAllocator(pinned=False, name="kit allocator") if platform.name == "kitchip" else None
    """
    install_plugin("kitchip", source)
    runtime = vllm_port.load(plugins="kitchip")
    assert (runtime.platform.name, runtime.selected.error, runtime.selected.api_range) == ("kitchip", None, ">=1.0,<2")
    assert runtime.allocator().name == "kit allocator"


REPO = Path(__file__).resolve().parents[2]
IN_TREE = ("cpu", "cuda", "rocm", "xpu")


def _plugin_sources(tmp_path: Path) -> list[Path]:
    """Every module of the in-tree plugins, and of a package generated by ``new-plugin`` for each kind of device."""
    generated = [new_plugin(f"kit{d}", tmp_path / d, device_type=d).root for d in ("cpu", "cuda", "xpu", "mps")]
    return [*sorted(REPO.glob("plugins/*/src/*/*.py")), *(p for root in generated for p in sorted(root.rglob("*.py")))]


def _calls_globals(source: str) -> bool:
    tree = ast.parse(source)
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "globals" for n in ast.walk(tree)
    )


def test_no_plugin_module_writes_its_names_through_globals(tmp_path: Path) -> None:
    """A reader (and grep) finds every hook where it is defined: no ``globals().update(...)``, no ``globals()[...]``."""
    sources = _plugin_sources(tmp_path)
    assert {p.parent.name for p in sources} >= {f"vllm_port_{name}" for name in IN_TREE}
    assert len(sources) > 30  # the four plugins' modules and four generated packages
    assert [str(p) for p in sources if _calls_globals(p.read_text(encoding="utf-8"))] == []


@pytest.mark.parametrize("name", IN_TREE)
def test_every_hook_of_an_in_tree_plugin_is_a_function_of_its_entry_point_module(name: str) -> None:
    entry = next(ep for ep in metadata.entry_points(group="vllm_port") if ep.name == name)
    module = importlib.import_module(entry.value)
    hooks = {attr: getattr(module, attr) for attr in dir(module) if attr.startswith("vllm_port_")}
    assert {"vllm_port_api_range", "vllm_port_platform_describe", "vllm_port_platform_probe"} <= set(hooks)
    source = Path(module.__file__).read_text(encoding="utf-8")
    for attr, function in hooks.items():
        assert hasattr(function, "vllm_port_impl"), f"{entry.value}.{attr} is no @hookimpl"
        assert function.__module__ == module.__name__, f"{entry.value}.{attr} comes from {function.__module__}"
        assert f"@hookimpl\ndef {attr}(" in source
