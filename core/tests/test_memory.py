"""The allocator base class: checks and accounting that every vendor allocator inherits."""

import pytest
import torch

from vllm_port.memory import Allocator, MemoryContractError, OutOfMemoryError


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
