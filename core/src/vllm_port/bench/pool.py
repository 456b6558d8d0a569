"""Block-pool benchmark: block operations per second, and how much of a KV budget becomes blocks.

Batch calls count one op per block (``allocate(16)`` is 16 block ops), as the scheduler uses them.
Capacity is computed for Llama-3-8B's KV layout (32 layers, 8 KV heads, head size 128, bfloat16,
16 tokens a block: 2 MiB a block) at several budgets; the small budgets are also built for real
with :class:`vllm_port.memory.KVCache` on the selected platform's allocator.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable

import torch

from ..kv_pool import BlockPool, blocks_for_budget, hash_block_tokens, kv_block_bytes

GOAL_OPS = 1_000_000
NUM_BLOCKS, BLOCK_SIZE, BATCH = 4096, 16, 16
LLAMA3_8B = {"num_layers": 32, "num_kv_heads": 8, "head_size": 128, "block_size": 16, "dtype_bytes": 2}
GIB = 1 << 30


def _rate(fn: Callable[[], int], min_time_s: float = 0.2, repeats: int = 5) -> float:
    """Best of ``repeats`` of block ops per second; ``fn`` does some ops and returns how many."""
    best = 0.0
    for _ in range(repeats):
        ops, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_time_s:
            ops += fn()
        best = max(best, ops / elapsed)
    return best


def measure_ops() -> dict[str, float]:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)

    def alloc_free_batch() -> int:
        for _ in range(64):
            blocks = pool.allocate(BATCH)
            pool.free(blocks)  # type: ignore[arg-type]
        return 64 * 2 * BATCH

    def alloc_free_single() -> int:
        for _ in range(256):
            (b,) = pool.allocate(1)  # type: ignore[misc]
            pool.free([b])
        return 256 * 2

    shared = pool.allocate(BATCH)
    assert shared is not None

    def fork_free() -> int:
        for _ in range(64):
            pool.free(pool.fork(shared))
        return 64 * 2 * BATCH

    prefix = pool.allocate(256)
    assert prefix is not None
    hashes, parent = [], None
    for i, b in enumerate(prefix):
        parent = hash_block_tokens(parent, list(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)))
        pool.register(b, parent)
        hashes.append(parent)
    pool.free(prefix)  # cached-free: every lookup hits and revives a block
    lookup = pool.lookup

    def prefix_hit_free() -> int:
        got = [lookup(h) for h in hashes]
        pool.free(got)  # type: ignore[arg-type]
        return 2 * len(hashes)

    def prefix_lookup_hit() -> int:
        got = [lookup(h) for h in hashes]
        pool.free(got)  # type: ignore[arg-type]
        return len(hashes)  # lookups only counted; the free is the price of repeating

    misses = [h ^ 1 for h in hashes]

    def prefix_lookup_miss() -> int:
        for h in misses:
            lookup(h)
        return len(misses)

    tokens = list(range(BLOCK_SIZE))

    def hash_full_block() -> int:
        for _ in range(256):
            hash_block_tokens(12345, tokens)
        return 256

    return {
        "allocate+free, batches of 16": _rate(alloc_free_batch),
        "allocate+free, one block a call": _rate(alloc_free_single),
        "fork+free, batches of 16": _rate(fork_free),
        "prefix lookup hit + free": _rate(prefix_hit_free),
        "prefix lookup hit (free not counted)": _rate(prefix_lookup_hit),
        "prefix lookup miss": _rate(prefix_lookup_miss),
        "hash_block (16 tokens)": _rate(hash_full_block),
    }


def measure_capacity() -> list[dict[str, float | int | str]]:
    block_bytes = kv_block_bytes(**LLAMA3_8B)
    rows: list[dict[str, float | int | str]] = []
    for label, budget in (
        ("1 GiB", GIB),
        ("8 GiB", 8 * GIB),
        ("40 GiB (A100-40GB class)", 40 * GIB),
        ("0.9 x 141 GiB - 16 GiB weights (H200)", int(0.9 * 141 * GIB) - 16 * GIB),
        ("100,000,000 bytes", 100_000_000),
        ("17 MiB + 1 byte", 17 * (1 << 20) + 1),
    ):
        n = blocks_for_budget(budget, block_bytes)
        rows.append(
            {
                "budget": label,
                "budget_bytes": budget,
                "blocks": n,
                "tokens": n * LLAMA3_8B["block_size"],
                "fraction": n * block_bytes / budget,
            }
        )
    return rows


def measure_built(budgets: tuple[int, ...] = (64 << 20, 256 << 20)) -> list[dict[str, float | int | str]]:
    """Build the cache for real on the selected platform's allocator (small budgets only)."""
    import vllm_port

    from ..memory import KVLayout

    runtime = vllm_port.load()
    layout = KVLayout(32, 8, 128, 16, torch.bfloat16)
    rows: list[dict[str, float | int | str]] = []
    for budget in budgets:
        start = time.perf_counter()
        kv = runtime.kv_cache(layout, budget)
        rows.append(
            {
                "platform": runtime.platform.name,
                "budget_bytes": budget,
                "blocks": kv.num_blocks,
                "fraction": kv.capacity_fraction,
                "build_ms": (time.perf_counter() - start) * 1e3,
            }
        )
        kv.close()
    return rows


def main(json_path: str | None = None) -> int:
    machine = f"{platform.machine()}, Python {platform.python_version()}"
    print(f"block pool on {machine} ({NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens; best of 5 runs of 0.2 s)")
    ops = measure_ops()
    print(f"\n{'operation':<40}{'block ops/s':>14}")
    for name, rate in ops.items():
        print(f"{name:<40}{rate:>14,.0f}")
    pool_ops = {k: v for k, v in ops.items() if not k.startswith("hash_block")}
    slowest = min(pool_ops, key=pool_ops.__getitem__)
    met = pool_ops[slowest] >= GOAL_OPS
    print(
        f"\nslowest pool op: {slowest} at {pool_ops[slowest]:,.0f}/s; goal >= {GOAL_OPS:,}/s: {'met' if met else 'NOT met'}"
    )
    capacity = measure_capacity()
    print(f"\nLlama-3-8B KV layout, {kv_block_bytes(**LLAMA3_8B):,} bytes a block")
    print(f"{'budget':<40}{'blocks':>10}{'tokens':>12}{'usable':>9}")
    for row in capacity:
        print(f"{row['budget']:<40}{row['blocks']:>10,}{row['tokens']:>12,}{row['fraction']:>9.2%}")
    built = measure_built()
    print(f"\nbuilt with KVCache on the {built[0]['platform']} allocator")
    for row in built:
        print(
            f"{row['budget_bytes']:>14,} bytes: {row['blocks']:,} blocks, {row['fraction']:.2%} usable, "
            f"{row['build_ms']:.1f} ms to build"
        )
    result = {
        "machine": machine,
        "torch": torch.__version__,
        "num_blocks": NUM_BLOCKS,
        "block_size": BLOCK_SIZE,
        "ops_per_s": ops,
        "goal_ops_per_s": GOAL_OPS,
        "slowest_pool_op": slowest,
        "goal_met": met,
        "llama3_8b_block_bytes": kv_block_bytes(**LLAMA3_8B),
        "capacity": capacity,
        "built": built,
    }
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if met else 1
