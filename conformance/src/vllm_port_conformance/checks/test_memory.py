"""Memory contract: the allocator keeps honest accounts, the block pool its invariants, migration its bits.

The allocator's books (``stats()``) are checked against what the platform itself reports: free
memory (``mem_info()``: the driver's count on a device, ``/proc/meminfo`` for host memory) must fall
by a large allocation and recover once it is freed; a freed buffer's storage must be gone after
``empty_cache`` (nothing holds it), the process's resident memory must shrink for host tiers, and
torch's cache must give it back to the driver for a device tier on torch's accelerator.

Free host memory is a count over the whole machine: on a busy one, other processes start, exit and
allocate between two readings. So the allocation is large (512 MiB), a fall and a rise each count
when they are within half the buffer of its size, and each needs one such attempt in four; a
``mem_info`` that does not follow allocations (a constant, a count in the wrong unit) shows none,
and a leak is caught for certain by the storage check below. (Core's host allocator adds the free
pages on the kernel's per-CPU lists to MemAvailable: without them a freed 512 MiB buffer showed as
0-60% freed on Linux 6.18.)
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import unittest
import weakref
from collections.abc import Iterator

import pytest
import torch

from vllm_port.memory import Allocator, KVCache, KVLayout, MemoryContractError, OutOfMemoryError
from vllm_port_conformance.comm_memory_classes import (
    ALLOCATION_SIZES,
    HASH_BLOCK_SIZE,
    POOL_ALLOCATIONS,
    POOL_BLOCKS,
    SWAP_DEVICE_BLOCKS,
    SWAP_SPACE_BLOCKS,
    TOKEN_ID_CLASSES,
)
from vllm_port_conformance.pool_machine import pool_machine
from vllm_port_conformance.swap_check import check_swap_classes

#: bytes of the allocation whose effect on free memory is measured: far above /proc/meminfo's
#: usual drift between two readings, and quick to fill on two cores
LARGE_HOST = 512 << 20
LARGE_DEVICE = 1 << 30
#: a fall or rise of free memory counts when it is within these fractions of the allocation
FOLLOWS = (0.5, 1.5)
ATTEMPTS = 4
RELEASED_BYTES = 64 << 20  # above glibc's largest mmap threshold: freed host memory goes back to the OS


def _who(plugin, tier: str, alloc: Allocator) -> str:
    return f"plugin {plugin.record.name!r}, tier {tier!r}, allocator {alloc.name!r}"


@contextlib.contextmanager
def _naming(who: str) -> Iterator[None]:
    """Turn an allocator's exception into a failure that names the plugin, tier and allocator."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{who}: {type(exc).__name__}: {exc}") from exc


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def _rss() -> int:
    """The process's resident bytes (0 where /proc is missing: the check then relies on the rest)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _torch_caches(device: torch.device, tier: str) -> bool:
    """Whether ``tier``'s buffers come from torch's caching allocator of the current accelerator."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return tier == "device" and accelerator is not None and accelerator.type == device.type


def _give_back(alloc: Allocator, held: list[torch.Tensor]) -> None:
    """Free the buffer ``held`` holds and drop the last reference to it, then empty the allocator's cache."""
    alloc.free(held.pop())
    gc.collect()
    alloc.empty_cache()


def test_buffers_are_the_size_asked_and_disjoint(plugin):
    """Every buffer holds exactly the bytes asked for, on the tier's device, and no two live buffers
    share a byte, also when a freed buffer could be reused."""
    runtime = plugin.runtime()
    sizes = ALLOCATION_SIZES
    for tier in runtime.platform.memory_tiers:
        alloc = runtime.allocator(tier)
        who = _who(plugin, tier, alloc)
        with _naming(who):
            for n in (4096, 1 << 20):  # something a caching allocator may hand out again
                alloc.free(alloc.allocate(n))
            buffers = [alloc.allocate(n) for n in sizes]
        spans = []
        for buf, n in zip(buffers, sizes, strict=True):
            got = buf.numel() * buf.element_size()
            assert got == n and buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous(), (
                f"{who}: asked for {n} bytes, got a {buf.dim()}-d {buf.dtype} buffer of {got} bytes"
            )
            assert buf.device.type == (plugin.device.type if tier == "device" else "cpu"), f"{who}: on {buf.device}"
            spans.append((buf.data_ptr(), buf.data_ptr() + n, n))
        spans.sort()
        for (start, end, n), (next_start, _, next_n) in itertools.pairwise(spans):
            assert end <= next_start, (
                f"{who}: two live buffers overlap: {n} bytes at {start:#x} and {next_n} bytes at {next_start:#x}"
            )
        for i, buf in enumerate(buffers):
            buf.fill_(i + 1)
        for i, buf in enumerate(buffers):
            seen = torch.unique(buf).tolist()
            assert seen == [i + 1], (
                f"{who}: buffer {i} of {sizes[i]} bytes holds {seen}, not only {i + 1}: shared memory"
            )
        with _naming(who):
            for buf in buffers:
                alloc.free(buf)


def _fall_and_recovery(alloc: Allocator, nbytes: int, device: torch.device) -> tuple[int, int]:
    """Bytes free memory fell by when ``nbytes`` were allocated and written, and rose by once freed."""
    before = alloc.mem_info()[0]
    held = [alloc.allocate(nbytes)]
    held[0].fill_(0x5A)  # host pages count only once written
    _sync(device)
    during = alloc.mem_info()[0]
    _give_back(alloc, held)
    _sync(device)
    after = alloc.mem_info()[0]
    return before - during, after - during


def test_free_memory_falls_and_recovers_as_the_platform_reports(plugin):
    runtime = plugin.runtime()
    low, high = FOLLOWS
    for tier in runtime.platform.memory_tiers:
        alloc = runtime.allocator(tier)
        who = _who(plugin, tier, alloc)
        device = plugin.device if tier == "device" else torch.device("cpu")
        with _naming(who):
            free, _ = alloc.mem_info()
            nbytes = min(LARGE_DEVICE if device.type != "cpu" else LARGE_HOST, free // 8)
            attempts: list[tuple[int, int]] = []
            while len(attempts) < ATTEMPTS:
                attempts.append(_fall_and_recovery(alloc, nbytes, device))
                fell = any(low * nbytes <= f <= high * nbytes for f, _ in attempts)
                rose = any(low * nbytes <= r <= high * nbytes for _, r in attempts)
                if fell and rose:
                    break
            else:
                said = "; ".join(f"fell by {f:,}, rose by {r:,}" for f, r in attempts)
                raise AssertionError(
                    f"{who}: mem_info() does not follow the memory in use: for a written buffer of {nbytes:,} "
                    f"bytes the free bytes it reports {said} ({ATTEMPTS} attempts; a fall and a rise of "
                    f"{low:.0%}-{high:.0%} of the buffer must each show once). Report the platform's own free "
                    "memory, in bytes, read at each call"
                )


def test_freed_buffers_are_released(plugin):
    """After ``free`` and ``empty_cache`` nothing holds a buffer's storage, and the memory leaves the process
    (host tiers) or torch's cache (a device tier on torch's accelerator)."""
    runtime = plugin.runtime()
    for tier in runtime.platform.memory_tiers:
        alloc = runtime.allocator(tier)
        who = _who(plugin, tier, alloc)
        device = plugin.device if tier == "device" else torch.device("cpu")
        cached = _torch_caches(device, tier)
        with _naming(who):
            _sync(device)
            reserved_before = torch.accelerator.memory_reserved(device.index or 0) if cached else 0
            held = [alloc.allocate(RELEASED_BYTES)]
            held[0].fill_(1)
            _sync(device)
            storage = weakref.ref(held[0].untyped_storage())
            rss_held = _rss()
            _give_back(alloc, held)
            _sync(device)
        alive = storage() is not None  # a bool: pytest would print the storage's every byte
        assert not alive, (
            f"{who}: a freed buffer's storage is still alive after free() and empty_cache(): the allocator "
            "keeps a reference to it (a leak, even if stats() says it is freed)"
        )
        if device.type == "cpu" and rss_held:
            shrank = rss_held - _rss()
            assert shrank >= RELEASED_BYTES // 2, (
                f"{who}: the process's resident memory shrank by {shrank:,} bytes when a written buffer of "
                f"{RELEASED_BYTES:,} bytes was freed; the memory was not given back"
            )
        if cached:
            reserved = torch.accelerator.memory_reserved(device.index or 0)
            assert reserved <= reserved_before + RELEASED_BYTES // 2, (
                f"{who}: torch's caching allocator still reserves {reserved:,} bytes after free() and empty_cache() "
                f"({reserved_before:,} before the {RELEASED_BYTES:,}-byte buffer); empty_cache must give cached "
                "memory back to the driver"
            )


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


# -------------------------------------------------------------------------------------------------
# The classes the engine reaches (comm_memory_classes): whole block tables, vocabulary-wide token ids,
# swaps past 64 blocks in both directions
# -------------------------------------------------------------------------------------------------


def test_block_pool_serves_whole_block_tables(plugin):
    """A pool of 257 blocks hands out batches of 1, 64, 65 and the rest (a long prompt's block
    table in one call), every block once, the last included, and takes a 200-block table back."""
    factory = plugin.runtime().block_pool_factory()
    pool = factory(POOL_BLOCKS * 64, 64, HASH_BLOCK_SIZE)
    who = f"plugin {plugin.record.name!r}: block pool {type(pool).__name__}"
    assert pool.num_blocks == POOL_BLOCKS, f"{who}: a budget of {POOL_BLOCKS} blocks made {pool.num_blocks}"
    tables = []
    for n in POOL_ALLOCATIONS:
        free = pool.num_free
        got = pool.allocate(n)
        assert got is not None, f"{who}: allocate({n}) answered None (cannot allocate now) with {free} blocks free"
        assert len(got) == n == len(set(got)), f"{who}: allocate({n}) gave {len(got)} blocks, {len(set(got))} distinct"
        tables.append(got)
    handed = sorted(b for t in tables for b in t)
    assert handed == list(range(POOL_BLOCKS)), (
        f"{who}: batches of {list(POOL_ALLOCATIONS)} should hand out every block 0..{POOL_BLOCKS - 1} once; "
        f"missing {sorted(set(range(POOL_BLOCKS)) - set(handed))[:8]}, repeated or foreign "
        f"{sorted(b for b in set(handed) if handed.count(b) > 1 or not 0 <= b < POOL_BLOCKS)[:8]}"
    )
    assert pool.num_free == 0 and pool.allocate(1) is None, f"{who}: a full pool still hands out a block"
    pool.free([b for t in tables[1:] for b in t])  # one free of 256 blocks
    pool.free(tables[0])
    assert pool.num_free == POOL_BLOCKS, f"{who}: {pool.num_free} of {POOL_BLOCKS} blocks free after every free"
    whole = pool.allocate(POOL_BLOCKS)
    assert whole is not None and sorted(whole) == list(range(POOL_BLOCKS)), (
        f"{who}: allocate({POOL_BLOCKS}) of a free pool of {POOL_BLOCKS} blocks gave {whole if whole is None else len(whole)}"
    )
    pool.free(whole)


def test_block_hashes_tell_token_ids_apart(plugin):
    """Blocks of the engine's 16 tokens that differ in one token id, at any position, by any id class
    the vocabularies reach (past 2^8, past 2^16, Llama 3's and Qwen's last ids), or only in their
    parent, hash apart: an equal hash is a prefix-cache hit that serves another prompt's keys."""
    factory = plugin.runtime().block_pool_factory()
    pool = factory(8 * 64, 64, HASH_BLOCK_SIZE)
    who = f"plugin {plugin.record.name!r}: block pool {type(pool).__name__}"
    base = [TOKEN_ID_CLASSES[i % len(TOKEN_ID_CLASSES)] for i in range(HASH_BLOCK_SIZE)]
    parents = [None, pool.hash_block(None, base), pool.hash_block(None, base[::-1])]
    for parent in parents:
        assert pool.hash_block(parent, list(base)) == pool.hash_block(parent, base), (
            f"{who}: hash_block is not deterministic"
        )
        seen: dict[int, list[int]] = {}
        for position in range(HASH_BLOCK_SIZE):
            for token in TOKEN_ID_CLASSES:
                block = [*base[:position], token, *base[position + 1 :]]
                h = pool.hash_block(parent, block)
                other = seen.setdefault(h, block)
                assert other == block, (
                    f"{who}: hash_block({'a parent' if parent is not None else 'no parent'}, ...) gives {h:#x} to "
                    f"two blocks that differ at {[i for i in range(HASH_BLOCK_SIZE) if other[i] != block[i]]}: "
                    f"{other} and {block}; a prefix-cache lookup would serve one prompt's keys for the other"
                )
    by_parent = {pool.hash_block(p, base) for p in parents}
    assert len(by_parent) == len(parents), (
        f"{who}: the same tokens under {len(parents)} parents give {len(by_parent)} hashes"
    )


def test_swaps_of_every_class_are_bit_exact(plugin):
    """Swaps of 1, 64, 65 and 200 blocks, as runs and scattered (the last block of both caches
    included), as a list of pairs (the engine's) and an int64 tensor, out of a device cache into
    block-major swap space of every tier and back in, each direction checked against indexing."""
    runtime = plugin.runtime()
    migrator = runtime.migrator()
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_size=16, block_size=4, dtype=torch.bfloat16)
    device = runtime.kv_cache(layout, SWAP_DEVICE_BLOCKS * layout.block_bytes)
    try:
        for tier in runtime.platform.memory_tiers:
            # the engine's swap space is block-major in every tier; the device tier also copies layer-major
            for block_major in (True, False) if tier == "device" else (True,):
                space = KVCache(
                    runtime.allocator(tier),
                    layout,
                    SWAP_SPACE_BLOCKS * layout.block_bytes,
                    runtime.block_pool_factory(),
                    block_major=block_major,
                )
                try:
                    who = (
                        f"plugin {plugin.record.name!r}: migrator {type(migrator).__name__}, tier {tier!r} "
                        f"({'block-major' if block_major else 'layer-major'} swap space)"
                    )
                    check_swap_classes(migrator, device.blocks, space.blocks, who)
                finally:
                    space.close()
    finally:
        device.close()
