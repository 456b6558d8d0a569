"""The paged KV-cache block pool, in plain Python (no torch: the scheduler runs it on the host).

Vocabulary as in vLLM: a sequence owns a *block table*, a list of block ids; a block holds
``block_size`` tokens' keys and values. Blocks are reference counted so sequences that share a
prefix share its blocks (``fork``); a shared block about to be written is copied first
(``copy_on_write``). A *full* block may carry a content hash chained with its parent's
(``hash_block``); when its last reference goes, it joins an LRU of cached-free blocks that a later
``lookup`` can still hit until ``allocate`` evicts it for a plain block. The pool alone keeps that
order: ``cached_blocks`` answers it (least recently used first, the order ``allocate`` evicts in),
and ``evict`` drops chosen cached blocks' prefixes (a reclaimer's plan) so they are taken first.

Every method checks its arguments before it changes anything, so the pool stays consistent after
any :class:`MemoryContractError`. Running out of blocks is not an error: ``allocate`` answers
``None`` ("cannot allocate now") and the scheduler waits or preempts.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import MemoryContractError

__all__ = ["BlockPool", "PoolStats", "blocks_for_budget", "hash_block_tokens", "kv_block_bytes", "slot_mapping"]


@dataclass(frozen=True)
class PoolStats:
    """Prefix-cache counters of a pool: lookups that hit, that missed, and cached blocks evicted."""

    hits: int
    misses: int
    evictions: int


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """A 64-bit content hash of one block's tokens chained with its parent block's hash.

    Deterministic across processes and runs (blake2b, not Python's salted ``hash``).
    """
    head = b"root" if parent_hash is None else parent_hash.to_bytes(8, "little", signed=False)
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return int.from_bytes(hashlib.blake2b(head + body, digest_size=8).digest(), "little")


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MemoryContractError(f"{name} must be a positive int, got {value!r}")
    return value


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens, reference counted, with prefix caching."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = _positive("BlockPool num_blocks", num_blocks)
        self.block_size = _positive("BlockPool block_size", block_size)
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self._cached: OrderedDict[int, int] = OrderedDict()  # cached-free block -> hash, LRU first
        self._hash_of: dict[int, int] = {}  # block -> its registered hash
        self._by_hash: dict[int, int] = {}  # hash -> block
        self._held: dict[int, int] = {}  # block -> in-flight migrations holding it
        self._hits = self._misses = self._evictions = 0

    # --- checks (never mutate) -----------------------------------------------------------------

    def _check_ids(self, op: str, blocks: Iterable[int]) -> list[int]:
        blocks = list(blocks)
        n = self.num_blocks
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                raise MemoryContractError(f"{op}: block {b!r} is foreign to this pool of {n} blocks (ids 0..{n - 1})")
        return blocks

    def _check_allocated(self, op: str, blocks: Iterable[int]) -> list[int]:
        blocks = self._check_ids(op, blocks)
        ref = self._ref
        for b in blocks:
            if ref[b] == 0:
                raise MemoryContractError(f"{op}: block {b} is free (not allocated); {op} needs an allocated block")
        return blocks

    # --- allocation ----------------------------------------------------------------------------

    def allocate(self, n: int = 1) -> list[int] | None:
        """``n`` blocks with one reference each, or ``None`` when fewer than ``n`` can be had now.

        Plain free blocks go first; then cached-free blocks are evicted, least recently used first.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise MemoryContractError(f"allocate needs a non-negative int of blocks, got {n!r}")
        free = self._free
        if n > len(free) + len(self._cached):
            return None
        if n <= len(free):
            blocks = free[len(free) - n :]
            del free[len(free) - n :]
            blocks.reverse()
        else:
            blocks = free[::-1]
            free.clear()
            evict = n - len(blocks)
            cached, hash_of, by_hash = self._cached, self._hash_of, self._by_hash
            for _ in range(evict):
                b, h = cached.popitem(last=False)
                del hash_of[b], by_hash[h]
                blocks.append(b)
            self._evictions += evict
        ref = self._ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block at zero becomes free, or cached-free if hashed.

        :raises MemoryContractError: for a foreign block, a double free (more frees than
            references, repeats in ``blocks`` included) or a block held by an in-flight migration.
        """
        blocks = self._check_ids("free", blocks)
        ref, held = self._ref, self._held
        pending: dict[int, int] = {}
        for b in blocks:
            pending[b] = pending.get(b, 0) + 1
            if pending[b] > ref[b]:
                raise MemoryContractError(f"free: double free of block {b} (it has {ref[b]} reference(s))")
            if b in held:
                raise MemoryContractError(
                    f"free: block {b} is in flight in {held[b]} migration(s); wait() on the handle before freeing it"
                )
        hash_of, cached, free = self._hash_of, self._cached, self._free
        for b in blocks:
            ref[b] -= 1
            if ref[b] == 0:
                if b in hash_of:
                    cached[b] = hash_of[b]
                else:
                    free.append(b)

    def fork(self, blocks: Iterable[int]) -> list[int]:
        """Take one more reference to each block (a sequence sharing a prefix); returns the blocks."""
        blocks = self._check_allocated("fork", blocks)
        ref = self._ref
        for b in blocks:
            ref[b] += 1
        return blocks

    def copy_on_write(self, block: int) -> tuple[int, int | None] | None:
        """Make ``block`` safe to write for one holder of it.

        :return: ``(new, old)`` when the block was shared: the caller copies ``old``'s data into
            ``new`` and writes ``new`` (one reference moved from ``old`` to ``new``);
            ``(block, None)`` when the caller held the only reference (any registered prefix hash
            is dropped, since the content is about to change); ``None`` when a copy is needed but
            no block can be allocated now.
        """
        (block,) = self._check_allocated("copy_on_write", [block])
        if block in self._held:
            raise MemoryContractError(f"copy_on_write: block {block} is in flight in a migration; wait() first")
        if self._ref[block] == 1:
            h = self._hash_of.pop(block, None)
            if h is not None:
                del self._by_hash[h]
            return block, None
        new = self.allocate(1)
        if new is None:
            return None
        self._ref[block] -= 1
        return new[0], block

    # --- prefix caching ------------------------------------------------------------------------

    def hash_block(self, parent_hash: int | None, token_ids: Sequence[int]) -> int:
        """The content hash of a FULL block of ``block_size`` tokens, chained with its parent's hash."""
        if len(token_ids) != self.block_size:
            raise MemoryContractError(
                f"hash_block: only full blocks are hashed; got {len(token_ids)} tokens, block_size is {self.block_size}"
            )
        return hash_block_tokens(parent_hash, token_ids)

    def register(self, block: int, block_hash: int) -> int:
        """Record that allocated ``block`` holds the full block of ``block_hash``.

        :return: the block that now answers ``lookup(block_hash)``: ``block``, or an earlier block
            that already holds the same content (the caller may keep either).
        """
        (block,) = self._check_allocated("register", [block])
        known = self._hash_of.get(block)
        if known is not None and known != block_hash:
            raise MemoryContractError(f"register: block {block} already holds hash {known:#x}, not {block_hash:#x}")
        owner = self._by_hash.get(block_hash)
        if owner is not None:
            return owner
        self._hash_of[block] = block_hash
        self._by_hash[block_hash] = block
        return block

    def lookup(self, block_hash: int) -> int | None:
        """The block holding ``block_hash``, with a new reference the caller frees; ``None`` on a miss."""
        b = self._by_hash.get(block_hash)
        if b is None:
            self._misses += 1
            return None
        self._hits += 1
        if self._ref[b] == 0:
            del self._cached[b]
        self._ref[b] += 1
        return b

    def cached_blocks(self) -> tuple[int, ...]:
        """The cached-free blocks in eviction order: least recently used first, as ``allocate`` evicts them."""
        return tuple(self._cached)

    def evict(self, blocks: Iterable[int]) -> None:
        """Drop the prefixes of cached-free ``blocks``: each becomes plain free, taken by ``allocate`` before
        any cached block (the scheduler evicts what a reclaimer chose, in the plan's order).

        :raises MemoryContractError: for a block that is not cached-free (in use, plain free or foreign),
            or named twice; nothing changes then.
        """
        blocks = self._check_ids("evict", blocks)
        cached, seen = self._cached, set()
        for b in blocks:
            if b not in cached:
                state = f"has {self._ref[b]} reference(s)" if self._ref[b] else "holds no prefix"
                raise MemoryContractError(
                    f"evict: block {b} is not cached-free (it {state}); only blocks in cached_blocks() can be evicted"
                )
            if b in seen:
                raise MemoryContractError(f"evict: block {b} is named twice")
            seen.add(b)
        for b in blocks:
            del self._by_hash[cached.pop(b)], self._hash_of[b]
            self._free.append(b)
        self._evictions += len(blocks)

    # --- in-flight migrations ------------------------------------------------------------------

    def hold(self, blocks: Iterable[int]) -> None:
        """Mark allocated blocks as in flight (a migration reads or writes them): free is refused."""
        blocks = self._check_allocated("hold", blocks)
        for b in blocks:
            self._held[b] = self._held.get(b, 0) + 1

    def release(self, blocks: Iterable[int]) -> None:
        """End one ``hold`` of each block."""
        blocks = self._check_ids("release", blocks)
        pending: dict[int, int] = {}
        for b in blocks:
            pending[b] = pending.get(b, 0) + 1
            if pending[b] > self._held.get(b, 0):
                raise MemoryContractError(f"release: block {b} is not held")
        for b in blocks:
            self._held[b] -= 1
            if self._held[b] == 0:
                del self._held[b]

    # --- state ---------------------------------------------------------------------------------

    def ref_count(self, block: int) -> int:
        (block,) = self._check_ids("ref_count", [block])
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is free but still holds a prefix that ``lookup`` can hit."""
        return block in self._cached

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: plain free plus cached-free."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (0.0 to 1.0)."""
        return 1.0 - self.num_free / self.num_blocks

    def stats(self) -> PoolStats:
        return PoolStats(self._hits, self._misses, self._evictions)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the pool's books disagree (for tests and conformance)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached-free"
        for b, r in enumerate(self._ref):
            assert r >= 0, f"block {b} has a negative reference count {r}"
            assert (r == 0) == (b in free or b in cached), f"block {b}: ref {r} disagrees with the free lists"
        assert all(self._ref[b] > 0 for b in self._held), "a held block is free"
        assert all(self._by_hash[h] == b for b, h in self._hash_of.items()), "hash maps disagree"
        assert len(self._by_hash) == len(self._hash_of), "hash maps disagree in size"
        assert all(b in self._hash_of for b in cached), "a cached-free block has no hash"


def slot_mapping(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slot (``block * block_size + offset``) of each token position in ``[start, end)``."""
    _positive("slot_mapping block_size", block_size)
    if not 0 <= start <= end or end > len(block_table) * block_size:
        raise MemoryContractError(
            f"slot_mapping: positions [{start}, {end}) do not fit a table of {len(block_table)} blocks "
            f"of {block_size} tokens"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_size: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes one block takes over all layers, keys and values, each ``[block_size, num_kv_heads, head_size]``."""
    for name, v in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("block_size", block_size),
        ("dtype_bytes", dtype_bytes),
    ):
        _positive(f"kv_block_bytes {name}", v)
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype_bytes


def blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many whole blocks of ``block_bytes`` fit in ``budget_bytes``."""
    _positive("blocks_for_budget budget_bytes", budget_bytes)
    _positive("blocks_for_budget block_bytes", block_bytes)
    return budget_bytes // block_bytes
