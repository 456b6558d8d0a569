"""The block pool: allocation, reference counts, copy-on-write, prefix caching, and its invariants."""

import ast
import inspect

import pytest

from vllm_port import kv_pool
from vllm_port.errors import VllmPortError
from vllm_port.kv_pool import BlockPool, blocks_for_budget, hash_block_tokens, kv_block_bytes, slot_mapping
from vllm_port.memory import MemoryContractError
from vllm_port_conformance.pool_machine import pool_machine


def test_the_module_does_not_import_torch():
    tree = ast.parse(inspect.getsource(kv_pool))
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "torch"]


def test_the_error_is_the_memory_contract_error():
    assert issubclass(MemoryContractError, VllmPortError)
    assert kv_pool.MemoryContractError is MemoryContractError


@pytest.mark.parametrize("args", [(0, 16), (-1, 16), (8, 0), (8, -2), (8.0, 16), (True, 16)])
def test_bad_sizes_are_refused(args):
    with pytest.raises(MemoryContractError, match="positive int"):
        BlockPool(*args)


def test_allocate_free_and_exhaustion():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1 and pool.usage == 0.75
    assert pool.allocate(2) is None and pool.num_free == 1  # exhaustion is an answer, not an error
    assert pool.allocate(0) == []
    pool.free(a)
    assert pool.num_free == 4 and pool.usage == 0.0
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3]
    pool.check_invariants()


def test_double_and_foreign_frees_are_refused_and_the_pool_stays_consistent():
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.free([a[0]])
    with pytest.raises(MemoryContractError, match=f"double free of block {a[0]}"):
        pool.free([a[1], a[0]])  # checked before anything changes: a[1] keeps its reference
    assert pool.ref_count(a[1]) == 1
    with pytest.raises(MemoryContractError, match="double free"):
        pool.free([a[1], a[1]])
    for bad in (4, -1, "2", None):
        with pytest.raises(MemoryContractError, match="foreign"):
            pool.free([bad])
    with pytest.raises(MemoryContractError, match="non-negative int"):
        pool.allocate(-1)
    assert pool.ref_count(a[1]) == 1 and pool.num_free == 3
    pool.check_invariants()


def test_fork_shares_and_copy_on_write_moves_one_reference():
    pool = BlockPool(4, 16)
    (b,) = pool.allocate(1)
    assert pool.fork([b]) == [b] and pool.ref_count(b) == 2
    new, old = pool.copy_on_write(b)
    assert old == b and new != b and pool.ref_count(b) == 1 and pool.ref_count(new) == 1
    assert pool.copy_on_write(b) == (b, None)  # sole owner writes in place
    pool.free([b, new])
    with pytest.raises(MemoryContractError, match="is free"):
        pool.fork([b])
    with pytest.raises(MemoryContractError, match="is free"):
        pool.copy_on_write(b)


def test_copy_on_write_answers_none_when_no_block_is_left():
    pool = BlockPool(1, 16)
    (b,) = pool.allocate(1)
    pool.fork([b])
    assert pool.copy_on_write(b) is None and pool.ref_count(b) == 2


def test_hashes_are_deterministic_chained_and_only_for_full_blocks():
    pool = BlockPool(4, 4)
    h0 = pool.hash_block(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, [1, 2, 3, 4]) and 0 <= h0 < 2**64
    assert pool.hash_block(h0, [5, 6, 7, 8]) != pool.hash_block(None, [5, 6, 7, 8])
    assert pool.hash_block(None, [1, 2, 3, 4]) == h0
    with pytest.raises(MemoryContractError, match="full blocks"):
        pool.hash_block(None, [1, 2, 3])


def test_hash_is_stable_across_processes():
    import subprocess
    import sys

    code = "from vllm_port.kv_pool import hash_block_tokens as h; print(h(h(None, [1, 2]), [3, 4]))"
    out = subprocess.check_output([sys.executable, "-c", code], text=True, env={"PYTHONHASHSEED": "12345"})
    assert out == f"{hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])}\n"


def test_prefix_cache_hits_cached_free_blocks_until_evicted_lru_first():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    ha, hb = pool.hash_block(None, [1, 2]), pool.hash_block(None, [3, 4])
    assert pool.register(a, ha) == a and pool.register(b, hb) == b
    assert pool.lookup(ha) == a and pool.ref_count(a) == 2  # a hit takes a reference
    pool.free([a, a, b])
    assert pool.is_cached(a) and pool.is_cached(b) and pool.num_free == 3
    # a reached zero before b, so a is the least recently used cached-free block
    c = pool.allocate(2)  # the plain free block, then the least recently freed cached one
    assert c[0] == 2 and c[1] == a and pool.stats().evictions == 1
    assert pool.lookup(ha) is None and pool.lookup(hb) == b and pool.ref_count(b) == 1
    assert pool.stats() == kv_pool.PoolStats(hits=2, misses=1, evictions=1)
    pool.check_invariants()


def _cached_free(pool, contents):
    """Blocks holding ``contents`` (one block each), registered, then freed in order: cached-free, LRU first."""
    blocks = pool.allocate(len(contents))
    hashes = [pool.hash_block(None, c) for c in contents]
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    for b in blocks:
        pool.free([b])
    return blocks, hashes


def test_the_pool_answers_its_eviction_order_and_allocate_follows_it():
    pool = BlockPool(4, 2)
    (a, b, c), _ = _cached_free(pool, [[1, 1], [2, 2], [3, 3]])
    assert pool.cached_blocks() == (a, b, c)  # least recently freed first
    assert pool.lookup(pool.hash_block(None, [1, 1])) == a  # a hit takes a out of the cache ...
    pool.free([a])  # ... and freeing it again makes it the most recently used
    assert pool.cached_blocks() == (b, c, a)
    assert pool.allocate(1) == [3] and pool.cached_blocks() == (b, c, a)  # the plain free block goes first
    assert pool.allocate(2) == [b, c] and pool.cached_blocks() == (a,)  # then the cached ones, in that order
    pool.check_invariants()


def test_evict_drops_chosen_prefixes_and_allocate_takes_those_blocks_first():
    pool = BlockPool(3, 2)
    (a, b, c), (ha, hb, hc) = _cached_free(pool, [[1, 1], [2, 2], [3, 3]])
    pool.evict([c, b])  # not the LRU order: a reclaimer's choice
    assert pool.cached_blocks() == (a,) and pool.num_free == 3 and pool.num_cached == 1
    assert pool.stats().evictions == 2
    assert pool.lookup(hb) is None and pool.lookup(hc) is None
    assert sorted(pool.allocate(2)) == [b, c]  # the evicted blocks, before the cached one
    assert pool.cached_blocks() == (a,) and pool.lookup(ha) == a
    pool.check_invariants()


def test_evict_refuses_a_block_that_is_not_cached_free_and_changes_nothing():
    pool = BlockPool(4, 2)
    (a,), _ = _cached_free(pool, [[1, 1]])
    (used,) = pool.allocate(1)
    plain = next(x for x in range(4) if x not in (a, used))
    for bad, message in (
        (used, f"block {used} is not cached-free \\(it has 1 reference"),
        (plain, f"block {plain} is not cached-free \\(it holds no prefix"),
        (4, "foreign"),
        ("1", "foreign"),
    ):
        with pytest.raises(MemoryContractError, match=message):
            pool.evict([a, bad])  # checked before anything changes: a stays cached
        assert pool.cached_blocks() == (a,)
    with pytest.raises(MemoryContractError, match=f"block {a} is named twice"):
        pool.evict([a, a])
    assert pool.cached_blocks() == (a,) and pool.stats().evictions == 0
    pool.check_invariants()


def test_register_keeps_the_first_block_of_a_content_and_refuses_a_second_hash():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    h = pool.hash_block(None, [7, 7])
    assert pool.register(a, h) == a and pool.register(b, h) == a
    with pytest.raises(MemoryContractError, match="already holds hash"):
        pool.register(a, h + 1)
    (c,) = pool.allocate(1)
    pool.free([c])
    with pytest.raises(MemoryContractError, match="is free"):
        pool.register(c, h + 2)


def test_copy_on_write_of_a_sole_hashed_block_drops_its_hash():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    h = pool.hash_block(None, [1, 1])
    pool.register(a, h)
    assert pool.copy_on_write(a) == (a, None)
    assert pool.lookup(h) is None


def test_held_blocks_cannot_be_freed():
    pool = BlockPool(2, 2)
    (a,) = pool.allocate(1)
    pool.hold([a])
    with pytest.raises(MemoryContractError, match="in flight"):
        pool.free([a])
    pool.release([a])
    pool.free([a])
    with pytest.raises(MemoryContractError, match="not held"):
        pool.release([a])


def test_slot_mapping_and_sizes():
    assert slot_mapping([3, 0], 1, 6, 4) == [13, 14, 15, 0, 1]
    assert slot_mapping([], 0, 0, 4) == []
    with pytest.raises(MemoryContractError, match="do not fit"):
        slot_mapping([3], 0, 5, 4)
    # Llama-3-8B, bf16, 16 tokens a block: 32 layers x 8 KV heads x 128 x 2 bytes x 16 x (K and V) = 2 MiB
    assert kv_block_bytes(32, 8, 128, 16, 2) == 2 * 1024 * 1024
    assert blocks_for_budget(10 * 2**20 + 5, 2**20) == 10
    with pytest.raises(MemoryContractError):
        blocks_for_budget(0, 1)
    with pytest.raises(MemoryContractError):
        kv_block_bytes(32, 0, 128, 16, 2)


TestPoolMachine = pool_machine(BlockPool, max_examples=200, steps=50)
TestPoolMachine.pytestmark = [pytest.mark.slow]  # 200 examples of 50 steps: about 3.5 CPU s
