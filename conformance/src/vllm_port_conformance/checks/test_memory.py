"""Memory contract (first part): the platform's allocator keeps honest accounts."""

from __future__ import annotations

import pytest

from vllm_port.memory import MemoryContractError


def test_allocation_accounting_returns_to_baseline(plugin):
    alloc = plugin.runtime().allocator()
    before = alloc.stats()
    buffers = [alloc.allocate(n) for n in (1, 4096, 1 << 20)]
    assert alloc.stats().allocated == before.allocated + 1 + 4096 + (1 << 20)
    for buf in buffers:
        assert buf.device.type == plugin.device.type
        alloc.free(buf)
    assert alloc.stats().allocated == before.allocated


def test_double_free_is_refused(plugin):
    alloc = plugin.runtime().allocator()
    buf = alloc.allocate(256)
    alloc.free(buf)
    with pytest.raises(MemoryContractError):
        alloc.free(buf)


def test_memory_info_is_sane(plugin):
    free, total = plugin.runtime().allocator().mem_info()
    assert 0 < free <= total
