"""The swap benchmark's plumbing, on CPU (its numbers come from a GPU: docs/results/swap-h200.md)."""

import pytest
import torch

from vllm_port.bench import swap
from vllm_port.memory import HostMemoryAllocator, KVCache, KVLayout, TorchMigrator

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.bfloat16)


def _caches():
    alloc = HostMemoryAllocator(pinned=False)
    device = KVCache(alloc, LAYOUT, 16 * LAYOUT.block_bytes)
    host = KVCache(alloc, LAYOUT, 16 * LAYOUT.block_bytes, block_major=True)
    host_layers = KVCache(alloc, LAYOUT, 16 * LAYOUT.block_bytes)
    device.buffer.view(torch.int16).random_(0, 1 << 14)  # finite bfloat16s: torch.equal sees every bit
    return device, host, host_layers


def test_measure_times_every_pattern_and_direction():
    rows = swap.measure(TorchMigrator(), *_caches(), counts=(4, 99), repeats=2)
    assert [(r["pattern"], r["direction"]) for r in rows] == [(p, d) for p in swap.PATTERNS for d in ("out", "in")]
    assert all(r["blocks"] == 4 and r["bytes"] == 4 * LAYOUT.block_bytes and r["migrator_GBps"] > 0 for r in rows)


@pytest.mark.parametrize("pattern", swap.PATTERNS)
def test_the_timed_swaps_move_real_blocks(pattern):
    device, host, host_layers = _caches()
    original = device.blocks.clone()
    swap.measure(TorchMigrator(), device, host, host_layers, counts=(5,), repeats=1, patterns=(pattern,))
    # the peer's plain copies overwrite the first bytes of each buffer: compare the migrated blocks
    for d, h in swap._pairs(pattern, 5, 16, 16, seed=5):
        for layer in range(LAYOUT.num_layers):
            if pattern == "per-layer":
                assert torch.equal(host_layers.key_caches[layer][h], original[d, 0, layer])
                assert torch.equal(host_layers.value_caches[layer][h], original[d, 1, layer])
            else:
                assert torch.equal(host.blocks[h], original[d])
        assert torch.equal(device.blocks[d], original[d])


def test_a_platform_without_pinned_host_memory_has_nothing_to_swap_to(capsys):
    assert swap.main(device_name="cpu") == 2
    assert "no pinned_host tier" in capsys.readouterr().out
