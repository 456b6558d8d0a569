"""Mutants of the memory and platform parts: allocators that lie, probes that hang, migrators and
block pools that are right on small swaps and small pools only.

An allocator, a migrator, a block pool and a probe are one per platform, so each mutant is a platform plugin of its own (one
``vllm-port certify`` run each). The plugins register no providers, so their runs do only the
platform, memory and comm checks (plus three skips of the op checks, which alone would refuse them;
each mutant's own check must fail as well, naming the plugin). Every plugin is a host-memory "device"
like the CPU platform, with one planted bug.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

#: The hooks every mutant shares: a host-memory platform named after the plugin.
_PLATFORM = """
import threading
import time

import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.memory import HostMemoryAllocator, host_memory

NAME = {name!r}


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name=NAME, device_type="cpu", priority=1, dist_backend="gloo")
"""

_PROBE = """
@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "host memory as a test device", (DeviceInfo("test device", host_memory()[1], "test"),))
"""

_ALLOCATOR_HOOK = """
@hookimpl
def vllm_port_allocator(platform):
    return Allocator() if platform.name == NAME else None
"""


_MIGRATOR_HOOK = """
@hookimpl
def vllm_port_migrator(platform):
    return Migrator() if platform.name == NAME else None
"""

_POOL_HOOK = """
@hookimpl
def vllm_port_block_pool(platform):
    if platform.name != NAME:
        return None
    return lambda budget, block_bytes, block_size: Pool(blocks_for_budget(budget, block_bytes), block_size)
"""


def _allocator_plugin(name: str, allocator: str) -> str:
    return _PLATFORM.format(name=name) + _PROBE + allocator + _ALLOCATOR_HOOK


def _migrator_plugin(name: str, migrator: str) -> str:
    imports = "\nfrom vllm_port.memory import TorchMigrator\n"
    return _PLATFORM.format(name=name) + imports + _PROBE + migrator + _MIGRATOR_HOOK


def _pool_plugin(name: str, pool: str) -> str:
    imports = "\nfrom vllm_port.kv_pool import BlockPool, blocks_for_budget\n"
    return _PLATFORM.format(name=name) + imports + _PROBE + pool + _POOL_HOOK


def _probe_plugin(name: str, probe: str) -> str:
    return _PLATFORM.format(name=name) + probe


LEAK = '''
class Allocator(HostMemoryAllocator):
    """Frees lazily: a freed buffer waits in a list to be released at a quiet moment."""

    def __init__(self):
        super().__init__(pinned=False, name="lazy-free allocator")
        self._to_release = []

    def _free(self, buffer):
        self._to_release.append(buffer)  # BUG: the quiet moment never comes; the books say freed, the storage lives
'''

STALE_INFO = '''
class Allocator(HostMemoryAllocator):
    """Reads /proc/meminfo once, at start-up, to save a file read per call."""

    def __init__(self):
        super().__init__(pinned=False, name="snapshot allocator")
        self._info = host_memory()

    def _mem_info(self):
        return self._info  # BUG: free memory frozen at start-up, whatever is allocated since
'''

SHORT = '''
class Allocator(HostMemoryAllocator):
    """Hands out whole 4 KiB pages."""

    def __init__(self):
        super().__init__(pinned=False, name="page allocator")

    def _alloc(self, nbytes):
        pages = max(1, nbytes // 4096)  # BUG: rounds down, not up: an odd size loses its tail
        return torch.empty(pages * 4096, dtype=torch.uint8)[:nbytes]
'''

HUGE_PAGES = '''
class Allocator(HostMemoryAllocator):
    """Carves buffers of 4 MiB or more from one slab of 2 MiB huge pages, one after the other."""

    def __init__(self):
        super().__init__(pinned=False, name="huge-page allocator")
        self._slab = torch.empty(64 << 20, dtype=torch.uint8)
        self._next = 0

    def _alloc(self, nbytes):
        if nbytes < 4 << 20:
            return super()._alloc(nbytes)
        start = self._next
        self._next += nbytes // (2 << 20) * (2 << 20)  # BUG: rounds down: the remainder overlaps the next buffer
        return self._slab[start : start + nbytes]

    def _free(self, buffer):
        if buffer.untyped_storage().data_ptr() != self._slab.untyped_storage().data_ptr():
            super()._free(buffer)
'''

SHARED = '''
class Allocator(HostMemoryAllocator):
    """Keeps freed buffers by size and hands them out again (a caching allocator)."""

    def __init__(self):
        super().__init__(pinned=False, name="reusing allocator")
        self._cached = {}

    def _alloc(self, nbytes):
        cached = self._cached.get(nbytes)
        if cached:
            return cached[-1]  # BUG: meant pop(): the buffer stays cached and is handed out again while live
        return torch.empty(nbytes, dtype=torch.uint8)

    def _free(self, buffer):
        self._cached.setdefault(buffer.numel(), []).append(buffer)

    def _empty_cache(self):
        self._cached.clear()
'''

NO_EMPTY = '''
class Allocator(HostMemoryAllocator):
    """Keeps freed buffers by size and hands them out again (a caching allocator)."""

    def __init__(self):
        super().__init__(pinned=False, name="caching allocator")
        self._cached = {}

    def _alloc(self, nbytes):
        cached = self._cached.get(nbytes)
        return cached.pop() if cached else torch.empty(nbytes, dtype=torch.uint8)

    def _free(self, buffer):
        self._cached.setdefault(buffer.numel(), []).append(buffer)

    def _empty_cache(self):
        for blocks in self._cached.values():
            blocks.clear  # BUG: the call's parentheses are missing: empty_cache releases nothing
'''

FIRST_64 = '''
class Migrator(TorchMigrator):
    """Copies blocks with one program per pair."""

    GRID = 64  # programs a launch may have

    def _launch(self, src, dst, src_ids, dst_ids):
        n = min(len(src_ids), self.GRID)  # BUG: the grid is capped and no program loops: pairs past 64 are dropped
        return super()._launch(src, dst, src_ids[:n], dst_ids[:n])
'''

SWAP_LAST_BLOCK = '''
class Migrator(TorchMigrator):
    """Copies blocks; the swap space (block-major, contiguous) through a mapping of its bytes."""

    def _launch(self, src, dst, src_ids, dst_ids):
        def mapped(cache, block):  # BUG: the mapping is sized (num_blocks - 1) blocks: an off-by-one in its length
            return not cache.is_contiguous() or block < cache.shape[0] - 1

        keep = [(a, b) for a, b in zip(src_ids, dst_ids) if mapped(src, a) and mapped(dst, b)]
        if keep:  # pairs outside the mapping are skipped, silently
            super()._launch(src, dst, [a for a, _ in keep], [b for _, b in keep])
        return None
'''

SOURCE_RUNS = '''
class Migrator(TorchMigrator):
    """Coalesces runs of consecutive blocks into one copy each."""

    def _launch(self, src, dst, src_ids, dst_ids):
        start = 0
        while start < len(src_ids):
            end = start + 1
            while end < len(src_ids) and src_ids[end] == src_ids[end - 1] + 1:  # BUG: only the source ids are
                end += 1  # checked for a run; the destination ids are assumed consecutive too
            first, n = dst_ids[start], end - start
            dst[first : first + n].copy_(src[src_ids[start] : src_ids[start] + n])
            start = end
        return None
'''

POOL_ONE_WORD = '''
class Pool(BlockPool):
    """Tracks free blocks in a bitmap of 64-bit words."""

    def allocate(self, n=1):
        if isinstance(n, int) and n > 64:  # BUG: one call searches one word: more than 64 blocks is "not now"
            return None
        return super().allocate(n)
'''

POOL_HASH_16 = '''
class Pool(BlockPool):
    """Hashes blocks' token ids packed small, to halve the bytes hashed."""

    def hash_block(self, parent_hash, token_ids):
        packed = [t & 0xFFFF for t in token_ids]  # BUG: 16 bits a token "fit every vocabulary": Llama 3's 128,256 do not
        return super().hash_block(parent_hash, packed)
'''

HANG = """
@hookimpl
def vllm_port_platform_probe():
    threading.Event().wait()  # BUG: waits on a driver lock that nobody releases
    return ProbeResult(False, "never reached")
"""

SLOW_FIRST = """
_ready = False


@hookimpl
def vllm_port_platform_probe():
    global _ready
    if not _ready:  # BUG: the first probe starts the vendor's runtime (a lazy import), which takes a minute
        time.sleep(60)
        _ready = True
    return ProbeResult(True, "host memory as a test device", (DeviceInfo("test device", host_memory()[1], "test"),))
"""


def _group(name: str, source: str, bug: str, bug_class: str, check: str, *message: str) -> MutantGroup:
    return MutantGroup(name, source, (Mutant(name, bug, bug_class, check, tuple(message)),))


GROUPS: list[MutantGroup] = [
    _group(
        "mem-leak",
        _allocator_plugin("mem-leak", LEAK),
        "free() updates the books but keeps every freed buffer alive in a list (a leak)",
        "memory",
        "test_memory::test_freed_buffers_are_released",
        "still alive after free() and empty_cache()",
        "allocator 'lazy-free allocator'",
    ),
    _group(
        "mem-stale-info",
        _allocator_plugin("mem-stale-info", STALE_INFO),
        "mem_info() answers the free memory read once at start-up (constant)",
        "memory",
        "test_memory::test_free_memory_falls_and_recovers_as_the_platform_reports",
        "mem_info() does not follow the memory in use",
        "fell by 0, rose by 0",
    ),
    _group(
        "mem-short",
        _allocator_plugin("mem-short", SHORT),
        "allocate() rounds an odd size down to whole 4 KiB pages: a buffer smaller than asked",
        "memory",
        "test_memory::test_buffers_are_the_size_asked_and_disjoint",
        "_alloc(12,293) returned 12,288 bytes",
    ),
    _group(
        "mem-huge-pages",
        _allocator_plugin("mem-huge-pages", HUGE_PAGES),
        "buffers of several 2 MiB huge pages with a remainder (a KV cache of whole blocks) overlap the next one",
        "memory: buffers past a huge page",
        "test_memory::test_buffers_are_the_size_asked_and_disjoint",
        "two live buffers overlap",
        "allocator 'huge-page allocator'",
    ),
    _group(
        "mem-shared",
        _allocator_plugin("mem-shared", SHARED),
        "a caching allocator hands out a cached buffer without taking it off its list: two live allocations share it",
        "memory",
        "test_memory::test_buffers_are_the_size_asked_and_disjoint",
        "where a live buffer of this allocator starts",
    ),
    _group(
        "mem-no-empty",
        _allocator_plugin("mem-no-empty", NO_EMPTY),
        "a caching allocator whose empty_cache() releases nothing (a call without its parentheses)",
        "memory",
        "test_memory::test_freed_buffers_are_released",
        "still alive after free() and empty_cache()",
        "allocator 'caching allocator'",
    ),
    _group(
        "mig-first-64",
        _migrator_plugin("mig-first-64", FIRST_64),
        "the migrator's launch grid is capped at 64 programs, one per pair: a swap of more than 64 blocks drops the rest",
        "memory: swap size",
        "test_memory::test_swaps_of_every_class_are_bit_exact",
        "swap-out of 65 block(s), runs, as a list",
        "pair 64 of 65",
        "not copied",
    ),
    _group(
        "mig-swap-last-block",
        _migrator_plugin("mig-swap-last-block", SWAP_LAST_BLOCK),
        "the migrator maps the block-major swap space one block short: pairs naming its last block are skipped",
        "memory: last block",
        "test_memory::test_swaps_of_every_class_are_bit_exact",
        "swap-out of 1 block(s), scattered",
        "(block-major swap space)",
        "-> block 202), does not hold its source's bits",
    ),
    _group(
        "mig-source-runs",
        _migrator_plugin("mig-source-runs", SOURCE_RUNS),
        "the migrator coalesces runs of consecutive source blocks and assumes their destinations consecutive too",
        "memory: scattered mapping",
        "test_memory::test_swaps_of_every_class_are_bit_exact",
        "scattered, as a list",
        "does not hold its source's bits",
    ),
    _group(
        "pool-one-word",
        _pool_plugin("pool-one-word", POOL_ONE_WORD),
        "the block pool searches one 64-bit word of its bitmap a call: allocating more than 64 blocks is always 'not now'",
        "memory: allocation size",
        "test_memory::test_block_pool_serves_whole_block_tables",
        "allocate(65) answered None (cannot allocate now) with 192 blocks free",
    ),
    _group(
        "pool-hash-16-bit",
        _pool_plugin("pool-hash-16-bit", POOL_HASH_16),
        "the block pool hashes token ids packed in 16 bits: blocks differing by 65,536 in one id share a prefix-cache entry",
        "memory: token id range",
        "test_memory::test_block_hashes_tell_token_ids_apart",
        "a prefix-cache lookup would serve one prompt's keys for the other",
    ),
    _group(
        "probe-hang",
        _probe_plugin("probe-hang", HANG),
        "the probe waits forever on a lock",
        "probe",
        "test_platform::test_plugin_loaded_without_error",
        "vllm_port_platform_probe did not answer within the 5 s limit",
    ),
    _group(
        "probe-slow-first",
        _probe_plugin("probe-slow-first", SLOW_FIRST),
        "the first probe of a process takes a minute (a lazy start-up); repeated probes are instant",
        "probe",
        "test_platform::test_first_probe_of_a_fresh_process_is_within_the_limit",
        "the first probe of a fresh process took",
        "over the 5 s probe limit",
    ),
]
