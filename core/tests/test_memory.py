"""The allocator base class: checks and accounting that every vendor allocator inherits."""

import pytest
import torch

from vllm_port.memory import (
    Allocator,
    HostMemoryAllocator,
    MemoryContractError,
    MemoryStats,
    OutOfMemoryError,
    TorchDeviceAllocator,
    default_allocator,
)


class SmallDevice(Allocator):
    """A device of 1 KiB, to reach out-of-memory without touching real memory limits."""

    def __init__(self):
        super().__init__("small device", "cpu")

    def _alloc(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def _mem_info(self):
        return 1024 - self.stats().allocated, 1024


def test_accounting_returns_to_baseline_and_keeps_the_peak():
    alloc = SmallDevice()
    a, b = alloc.allocate(100), alloc.allocate(200)
    assert alloc.stats().allocated == 300 and alloc.stats().live_buffers == 2
    alloc.free(a)
    alloc.free(b)
    assert alloc.stats().allocated == 0 and alloc.stats().peak == 300 and alloc.stats().live_buffers == 0


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "8"])
def test_bad_sizes_are_refused(size):
    with pytest.raises(MemoryContractError, match="positive int of bytes"):
        SmallDevice().allocate(size)


def test_double_free_and_foreign_buffers_are_refused_and_accounting_stays_right():
    alloc = SmallDevice()
    buf = alloc.allocate(64)
    alloc.free(buf)
    with pytest.raises(MemoryContractError, match="already freed, or allocated elsewhere"):
        alloc.free(buf)
    with pytest.raises(MemoryContractError, match="does not own"):
        alloc.free(torch.empty(64, dtype=torch.uint8))
    assert alloc.stats().allocated == 0


def test_out_of_memory_names_the_sizes():
    alloc = SmallDevice()
    alloc.allocate(1000)
    with pytest.raises(OutOfMemoryError, match="cannot allocate 100 bytes, 24 bytes free") as info:
        alloc.allocate(100)
    assert (info.value.requested, info.value.free) == (100, 24)


class Misbehaving(SmallDevice):
    """``_alloc`` answers what ``answer(nbytes)`` gives."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def _alloc(self, nbytes):
        return self.answer(nbytes)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (lambda n: torch.empty(n - 1, dtype=torch.uint8), "returned 63 bytes"),
        (lambda n: torch.empty(n // 4, dtype=torch.float32), r"returned a 1-d torch.float32 tensor"),
        (lambda n: torch.empty(2, n, dtype=torch.uint8)[:, : n // 2], r"returned a 2-d torch.uint8 tensor"),
        (
            lambda n: torch.empty(2 * n, dtype=torch.uint8)[::2],
            r"returned a 1-d torch.uint8 tensor \(contiguous: False\)",
        ),
        (lambda n: bytearray(n), "returned bytearray, not a tensor"),
        (lambda n: torch.empty(n, dtype=torch.uint8, device="meta"), "returned a buffer on meta"),
    ],
)
def test_a_buffer_that_is_not_what_was_asked_is_refused_and_not_counted(answer, message):
    alloc = Misbehaving(answer)
    with pytest.raises(MemoryContractError, match=f"small device: _alloc.64. {message}.*exactly the bytes asked for"):
        alloc.allocate(64)
    assert alloc.stats() == MemoryStats(0, 0, 0)


def test_memory_of_a_live_buffer_handed_out_again_is_refused():
    shared = torch.empty(64, dtype=torch.uint8)
    alloc = Misbehaving(lambda n: shared)
    assert alloc.allocate(64) is shared
    with pytest.raises(MemoryContractError, match="where a live buffer of this allocator starts"):
        alloc.allocate(64)
    assert alloc.stats().live_buffers == 1 and alloc.stats().allocated == 64


def test_core_serves_a_default_device_allocator_for_cpu_and_the_current_accelerator(monkeypatch):
    host = default_allocator("cpu")
    assert isinstance(host, HostMemoryAllocator) and not host.pinned and "core's default" in host.name
    assert default_allocator("npu") is None  # no accelerator here, and none of that type
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    device = default_allocator("xpu")
    assert isinstance(device, TorchDeviceAllocator) and device.device == torch.device("xpu", 0)
    assert default_allocator("mtia") is None


def test_torch_device_allocator_counts_torch_cached_memory_as_free(monkeypatch):
    """A new buffer reuses what torch's caching allocator holds, so that is free to the caller."""
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda index: (100, 1000))
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda index: 300)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda index: 250)
    emptied = []
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: emptied.append(True))
    alloc = TorchDeviceAllocator("xpu")
    assert alloc.mem_info() == (150, 1000)
    alloc.empty_cache()
    assert emptied == [True]


def test_the_pinned_host_allocator_empties_torch_host_cache_only_with_an_accelerator(monkeypatch):
    emptied = []
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", lambda: emptied.append(True))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    HostMemoryAllocator(pinned=False).empty_cache()
    HostMemoryAllocator(pinned=True).empty_cache()
    assert emptied == [True]  # freed page-locked blocks wait in torch's host cache until then
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    HostMemoryAllocator(pinned=True).empty_cache()
    assert emptied == [True]
