"""A hypothesis state machine over a KV block pool, shared by core's tests and the conformance checks.

It drives allocate/free/fork/copy_on_write/lookup/register/evict at random against a model of who
holds which block, and asserts the pool's invariants after every step: no block both free and used,
reference counts never negative and equal to the model's, copy-on-write never changes a block
another sequence shares, a prefix hit returns the content registered, the cached-free blocks the
pool answers (``cached_blocks``) are free and each once, an evicted block's content is never hit
again, errors change nothing, and every block is reusable once all are freed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_port.memory import MemoryContractError

__all__ = ["PoolMachine", "pool_machine"]


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/free/fork/copy-on-write/lookup/register against a model of the references.

    Each sequence is a list of blocks it holds one reference to. The model's reference count is the
    number of holdings; the pool's must agree, and every block's data tag (what a writer wrote) must
    never change while another sequence shares the block.
    """

    NUM_BLOCKS, BLOCK_SIZE = 8, 2
    make_pool: Callable[[int, int], Any]

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.make_pool(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.seqs: list[list[int]] = []
        self.data: dict[int, object] = {}  # block -> what was written in it
        self.hashes: dict[int, int] = {}  # hash -> the data tag registered under it
        self.writes = 0

    def refs(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seq in self.seqs:
            for b in seq:
                counts[b] = counts.get(b, 0) + 1
        return counts

    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        free_before = self.pool.num_free
        got = self.pool.allocate(n)
        if n > free_before:
            assert got is None and self.pool.num_free == free_before
            return
        assert got is not None and len(set(got)) == n and not set(got) & set(self.refs())
        for b in got:
            self.writes += 1
            self.data[b] = ("fresh", self.writes)
        self.seqs.append(got)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.pool.free(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        self.seqs.append(self.pool.fork(list(self.seqs[i % len(self.seqs)])))

    @precondition(lambda self: any(self.seqs))
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def copy_on_write_and_write(self, i, j):
        seq = [s for s in self.seqs if s][i % sum(1 for s in self.seqs if s)]
        k = j % len(seq)
        block = seq[k]
        shared_data = {b: self.data[b] for b, r in self.refs().items() if r > 1 and b != block}
        answer = self.pool.copy_on_write(block)
        if answer is None:
            assert self.refs()[block] > 1 and self.pool.num_free == 0
            return
        new, old = answer
        if old is not None:
            assert old == block and new != block and new not in self.refs()
            seq[k] = new
            self.data[new] = self.data[block]  # the caller's copy
        else:
            assert new == block and self.refs()[block] == 1
        self.writes += 1
        self.data[new] = ("written", self.writes)
        for b, d in shared_data.items():  # no block some other sequence shares was written
            assert self.data[b] == d

    @precondition(lambda self: any(self.seqs))
    @rule(i=st.integers(0, 99), tokens=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def register(self, i, tokens):
        block = next(b for s in self.seqs[i % len(self.seqs) :] + self.seqs for b in s)
        h = self.pool.hash_block(None, tokens)
        try:
            canonical = self.pool.register(block, h)
        except MemoryContractError:
            return  # the block already holds another content's hash: refused, nothing changed
        if canonical != block:  # an earlier block holds this content: it must be what was registered
            assert self.data[canonical] == self.hashes[h]
        self.hashes[h] = self.data[canonical]

    @rule(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=2))
    def lookup(self, tokens):
        h = self.pool.hash_block(None, tokens)
        b = self.pool.lookup(h)
        if b is not None:
            assert self.data[b] == self.hashes[h]  # a hit returns the content registered, never another
            self.seqs.append([b])

    @rule(i=st.integers(0, 99))
    def evict(self, i):
        cached = self.pool.cached_blocks()
        if not cached:
            return
        block = cached[i % len(cached)]
        held = [h for h, tag in self.hashes.items() if tag == self.data[block]]  # what the block answers
        free_before = self.pool.num_free
        self.pool.evict([block])
        assert block not in self.pool.cached_blocks() and not self.pool.is_cached(block)
        assert self.pool.num_free == free_before  # still free, now plainly
        for h in held:
            assert self.pool.lookup(h) is None, f"block {block} was evicted, yet its content is still hit"

    @rule(bad=st.sampled_from([-1, NUM_BLOCKS, "x"]))
    def errors_leave_the_pool_unchanged(self, bad):
        before = [self.pool.ref_count(b) for b in range(self.NUM_BLOCKS)], self.pool.num_free
        free_block = next((b for b in range(self.NUM_BLOCKS) if b not in self.refs()), None)
        for call, arg in ((self.pool.free, [bad]), (self.pool.fork, [bad]), (self.pool.evict, [bad])):
            with pytest.raises(MemoryContractError):
                call(arg)
        used = next(iter(self.refs()), None)
        if used is not None:  # a block some sequence holds is never evicted
            with pytest.raises(MemoryContractError):
                self.pool.evict([used])
        if free_block is not None:
            with pytest.raises(MemoryContractError):
                self.pool.free([free_block])
            with pytest.raises(MemoryContractError):
                self.pool.fork([free_block])
        after = [self.pool.ref_count(b) for b in range(self.NUM_BLOCKS)], self.pool.num_free
        assert before == after

    @invariant()
    def books_agree(self):
        check = getattr(self.pool, "check_invariants", None)
        if check is not None:
            check()
        counts = self.refs()
        for b in range(self.NUM_BLOCKS):
            assert self.pool.ref_count(b) == counts.get(b, 0) >= 0
        assert self.pool.num_free == self.NUM_BLOCKS - len(counts)
        cached = self.pool.cached_blocks()
        assert len(set(cached)) == len(cached) == self.pool.num_cached <= self.pool.num_free
        assert not set(cached) & set(counts), "a cached-free block is held by a sequence"

    def teardown(self):
        for seq in self.seqs:
            self.pool.free(seq)
        assert self.pool.num_free == self.NUM_BLOCKS  # every block is reusable again
        assert len(self.pool.allocate(self.NUM_BLOCKS)) == self.NUM_BLOCKS


def pool_machine(make_pool: Callable[[int, int], Any], max_examples: int = 60, steps: int = 40) -> type:
    """A ``unittest.TestCase`` class running :class:`PoolMachine` on pools from ``make_pool(num_blocks, block_size)``.

    Derandomized: the same runs every time, so a failure reproduces and the run time is fixed.
    """
    machine = type("PoolMachineFor", (PoolMachine,), {"make_pool": staticmethod(make_pool)})
    case = machine.TestCase
    case.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        derandomize=True,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    return case
