"""Memory contract: the allocator keeps honest accounts, the block pool its invariants, migration its bits."""

from __future__ import annotations

import unittest

import pytest
import torch

from vllm_port.memory import KVLayout, MemoryContractError, OutOfMemoryError
from vllm_port_conformance.pool_machine import pool_machine


def test_allocation_accounting_returns_to_baseline(plugin):
    runtime = plugin.runtime()
    for tier in runtime.platform.memory_tiers:
        alloc = runtime.allocator(tier)
        before = alloc.stats()
        buffers = [alloc.allocate(n) for n in (1, 4096, 1 << 20)]
        assert alloc.stats().allocated == before.allocated + 1 + 4096 + (1 << 20), tier
        for buf in buffers:
            assert buf.device.type == (plugin.device.type if tier == "device" else "cpu"), tier
            assert buf.is_pinned() or tier != "pinned_host", "pinned_host tier gave pageable memory"
            alloc.free(buf)
        assert alloc.stats().allocated == before.allocated, tier


def test_double_free_is_refused(plugin):
    alloc = plugin.runtime().allocator()
    buf = alloc.allocate(256)
    alloc.free(buf)
    with pytest.raises(MemoryContractError):
        alloc.free(buf)


def test_memory_info_is_sane(plugin):
    free, total = plugin.runtime().allocator().mem_info()
    assert 0 < free <= total


# -------------------------------------------------------------------------------------------------
# The memory contract (second part): out-of-memory, the block pool, migration between tiers
# -------------------------------------------------------------------------------------------------


def test_out_of_memory_raises_naming_the_sizes(plugin):
    alloc = plugin.runtime().allocator()
    before = alloc.stats()
    free, _ = alloc.mem_info()
    asked = free + (1 << 30)  # more than the device says is free: refused before touching memory
    with pytest.raises(OutOfMemoryError) as info:
        alloc.allocate(asked)
    assert f"{asked:,}" in str(info.value) and info.value.requested == asked and info.value.free > 0
    assert alloc.stats() == before


def test_stats_stay_consistent_through_errors(plugin):
    alloc = plugin.runtime().allocator()
    before = alloc.stats()
    a, b = alloc.allocate(4096), alloc.allocate(8192)
    mid = alloc.stats()
    assert mid.allocated == before.allocated + 12288 and mid.live_buffers == before.live_buffers + 2
    assert mid.peak >= mid.allocated
    for bad in (0, -1):
        with pytest.raises(MemoryContractError):
            alloc.allocate(bad)
    alloc.free(a)
    with pytest.raises(MemoryContractError):
        alloc.free(a)
    alloc.free(b)
    after = alloc.stats()
    assert after.allocated == before.allocated and after.live_buffers == before.live_buffers
    assert after.peak >= mid.allocated


def test_block_pool_factory_sizes_the_pool_from_the_budget(plugin):
    factory = plugin.runtime().block_pool_factory()
    pool = factory(100 * 4096 + 17, 4096, 16)
    assert pool.num_blocks == 100 and pool.num_free == 100 and pool.block_size == 16


class TestBlockPoolInvariants:
    """The same derandomized state machine as core's tests, on the platform's block pool."""

    def test_state_machine(self, plugin):
        factory = plugin.runtime().block_pool_factory()
        case = pool_machine(lambda n, bs: factory(n * 64, 64, bs), max_examples=30, steps=30)
        result = unittest.TestResult()
        case("runTest").run(result)
        problems = result.failures + result.errors
        assert not problems, problems[0][1]


def test_migration_round_trip_is_bit_exact_between_tiers(plugin):
    """One layer's key cache to the same layer's cache in every tier (its own allocator) and back."""
    runtime = plugin.runtime()
    migrator = runtime.migrator()
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_size=64, block_size=16, dtype=torch.bfloat16)
    kv = runtime.kv_cache(layout, 16 * layout.block_bytes)
    try:
        cache = kv.key_caches[0]
        bits = torch.randint(
            -(2**15), 2**15, cache.shape, dtype=torch.int16, generator=torch.Generator().manual_seed(0)
        )
        cache.view(torch.int16).copy_(bits.to(cache.device))  # every bit pattern, NaN payloads included
        original = cache.view(torch.int16).cpu().clone()
        blocks = kv.pool.allocate(4)
        for tier in runtime.platform.memory_tiers:
            other_kv = runtime.kv_cache(layout, 8 * layout.block_bytes, tier=tier)
            try:
                other = other_kv.key_caches[0]
                out = migrator.copy_blocks(cache, other, torch.tensor([[b, i] for i, b in enumerate(blocks)]))
                out.wait()
                for b in blocks:
                    cache[b].zero_()
                back = migrator.copy_blocks(other, cache, torch.tensor([[i, b] for i, b in enumerate(blocks)]))
                back.wait()
                assert back.done()
                got = cache.view(torch.int16).cpu()
                for b in blocks:
                    assert torch.equal(got[b], original[b]), f"block {b} changed in a round trip through tier {tier!r}"
            finally:
                other_kv.close()
        kv.pool.free(blocks)
    finally:
        kv.close()


def test_swap_between_kv_caches_of_every_tier_is_bit_exact(plugin):
    """Swap out scattered blocks of a device KV cache into each tier's cache (block-major off the
    device), overwrite them, swap them back: every bit returns, and no other block changes."""
    runtime = plugin.runtime()
    migrator = runtime.migrator()
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_size=32, block_size=16, dtype=torch.bfloat16)
    device = runtime.kv_cache(layout, 24 * layout.block_bytes)
    try:
        bits = torch.randint(
            -(2**15),
            2**15,
            (device.buffer.numel() // 2,),
            dtype=torch.int16,
            generator=torch.Generator().manual_seed(1),
        )
        device.buffer.view(torch.int16).copy_(bits.to(device.buffer.device))
        original = device.blocks.cpu().clone()
        for tier in runtime.platform.memory_tiers:
            swap = runtime.kv_cache(layout, 16 * layout.block_bytes, tier=tier)
            try:
                victims = [17, 2, 3, 4, 11, 23, 0]
                slots = swap.pool.allocate(len(victims))
                slots = [slots[i] for i in (5, 0, 1, 2, 6, 4, 3)]  # some runs, some not
                out = migrator.copy_blocks(
                    device.blocks, swap.blocks, list(zip(victims, slots, strict=True)), dst_pool=swap.pool
                )
                out.wait()
                device.blocks[victims] = 0
                back = migrator.copy_blocks(
                    swap.blocks, device.blocks, list(zip(slots, victims, strict=True)), src_pool=swap.pool
                )
                back.wait()
                assert back.done()
                swap.pool.free(slots)
                got = device.blocks.cpu()
                for b in range(device.num_blocks):
                    assert torch.equal(got[b].view(torch.int16), original[b].view(torch.int16)), (
                        f"block {b} differs after a swap through tier {tier!r}"
                    )
            finally:
                swap.close()
    finally:
        device.close()
