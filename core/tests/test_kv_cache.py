"""The KV-cache builder and the default migrator, on CPU."""

import os

import pytest
import torch

import vllm_port
from vllm_port.kv_pool import BlockPool
from vllm_port.memory import (
    Allocator,
    HostMemoryAllocator,
    KVCache,
    KVLayout,
    MemoryContractError,
    OutOfMemoryError,
    TorchMigrator,
    consecutive_runs,
    copy_across_tiers,
    default_block_pool_factory,
    host_memory,
)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.bfloat16)  # 512 B a block


class FakeDevice(Allocator):
    """A device of ``total`` bytes of which ``free`` are free, backed by host memory."""

    def __init__(self, total=1 << 20, free=None):
        super().__init__("fake device", "cpu")
        self.total, self.base_free = total, total if free is None else free

    def _alloc(self, nbytes):
        return torch.empty(nbytes, dtype=torch.uint8)

    def _mem_info(self):
        return self.base_free - self.stats().allocated, self.total


@pytest.mark.parametrize("budget", [0.9, 0.5, 0.013, 100_000, 10_240, 1 << 20])
def test_budget_becomes_blocks_at_95_percent_or_more(budget):
    alloc = FakeDevice()
    kv = KVCache(alloc, LAYOUT, budget)
    assert LAYOUT.block_bytes == 512
    assert kv.capacity_fraction >= 0.95 and kv.num_blocks * 512 <= kv.budget_bytes
    assert isinstance(kv.pool, BlockPool) and kv.pool.num_blocks == kv.num_blocks
    assert len(kv.key_caches) == len(kv.value_caches) == 2
    assert kv.key_caches[1].shape == (kv.num_blocks, 4, 2, 8) and kv.key_caches[1].dtype == torch.bfloat16
    assert alloc.stats().allocated == kv.num_blocks * 512
    kv.close()
    assert alloc.stats().allocated == 0


def test_caches_are_disjoint_views_of_one_buffer():
    kv = KVCache(FakeDevice(), LAYOUT, 8 * 512)
    tensors = kv.key_caches + kv.value_caches
    for i, t in enumerate(tensors):
        t.fill_(i)
    for i, t in enumerate(tensors):
        assert torch.all(t == i)
        assert t.untyped_storage().data_ptr() == kv.buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize(("block_major", "head_major"), [(False, False), (True, False), (False, True)])
def test_blocks_view_holds_block_b_of_every_layer(block_major, head_major):
    kv = KVCache(FakeDevice(), LAYOUT, 8 * 512, block_major=block_major, head_major=head_major)
    for layer in range(LAYOUT.num_layers):
        kv.key_caches[layer].copy_(torch.arange(8).view(8, 1, 1, 1) + 100 * layer)
        kv.value_caches[layer].copy_(-torch.arange(8).view(8, 1, 1, 1) - 100 * layer)
    assert kv.blocks.shape == (8, 2, 2, 4, 2, 8)
    assert kv.blocks.is_contiguous() == block_major
    for b in (0, 5, 7):
        for layer in range(LAYOUT.num_layers):
            assert torch.all(kv.blocks[b, 0, layer] == b + 100 * layer)
            assert torch.all(kv.blocks[b, 1, layer] == -b - 100 * layer)
    kv.close()
    assert kv.blocks.numel() == 0


def test_a_head_major_cache_keeps_a_heads_rows_of_a_block_side_by_side_behind_the_contracts_shape():
    kv = KVCache(FakeDevice(), LAYOUT, 8 * 512, head_major=True)
    key = kv.key_caches[1]
    assert key.shape == (8, 4, 2, 8)  # [num_blocks, block_size, num_kv_heads, head_size], as every cache
    assert key.stride() == (4 * 2 * 8, 8, 4 * 8, 1)  # stored [num_blocks, num_kv_heads, block_size, head_size]
    key.copy_(torch.arange(8 * 4 * 2 * 8).view(8, 4, 2, 8))
    stored = kv.buffer.view(torch.bfloat16).view(2, 2, 8, 2, 4, 8)[0, 1]  # keys of layer 1, as they lie
    assert torch.equal(stored, key.permute(0, 2, 1, 3))
    assert torch.equal(stored[3, 1].flatten(), key[3, :, 1].flatten())  # block 3's rows of head 1: one run
    kv.close()


def test_a_cache_is_block_major_or_head_major_not_both():
    with pytest.raises(MemoryContractError, match="block-major .* or head-major"):
        KVCache(FakeDevice(), LAYOUT, 8 * 512, block_major=True, head_major=True)


def test_the_cpu_platforms_device_cache_is_head_major_and_its_swap_tier_block_major():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    assert runtime.platform.kv_head_major
    kv = runtime.kv_cache(LAYOUT, 8 * 512)
    assert kv.head_major and not kv.block_major and kv.key_caches[0].stride(1) == LAYOUT.head_size
    kv.close()


def test_fraction_budget_follows_free_memory():
    kv = KVCache(FakeDevice(total=1 << 20, free=1 << 19), LAYOUT, 0.5)
    assert kv.budget_bytes == 1 << 18


def test_a_budget_larger_than_the_device_names_both_sizes():
    with pytest.raises(MemoryContractError, match=r"2,097,152 bytes is larger than the device's 1,048,576 bytes"):
        KVCache(FakeDevice(), LAYOUT, 2 << 20)


def test_a_budget_larger_than_free_memory_is_out_of_memory():
    with pytest.raises(OutOfMemoryError, match="999,936 bytes, 1,024 bytes free"):
        KVCache(FakeDevice(free=1024), LAYOUT, 1_000_000)


@pytest.mark.parametrize("budget", [0.0, 1.5, -5, True, "1"])
def test_bad_budgets_are_refused(budget):
    with pytest.raises(MemoryContractError):
        KVCache(FakeDevice(), LAYOUT, budget)


def test_a_budget_below_one_block_is_refused():
    with pytest.raises(MemoryContractError, match="holds no block"):
        KVCache(FakeDevice(), LAYOUT, 100)


def test_runtime_serves_the_defaults():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    assert runtime.block_pool_factory() is default_block_pool_factory
    assert isinstance(runtime.migrator(), TorchMigrator)
    kv = runtime.kv_cache(LAYOUT, 64 * 512)
    assert kv.num_blocks == 64
    kv.close()


def test_runtime_serves_only_the_tiers_the_platform_declares():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    with pytest.raises(MemoryContractError, match="has no memory tier 'pinned_host'; its tiers are device"):
        runtime.allocator("pinned_host")
    with pytest.raises(MemoryContractError, match="no memory tier 'hbm'"):
        runtime.kv_cache(LAYOUT, 64 * 512, tier="hbm")


def test_host_allocator_accounts_and_reads_meminfo(tmp_path):
    alloc = HostMemoryAllocator(pinned=False)
    buffer = alloc.allocate(4096)
    assert buffer.device.type == "cpu" and alloc.stats().allocated == 4096
    alloc.free(buffer)
    assert alloc.stats().allocated == 0
    free, total = alloc.mem_info()
    assert 0 < free <= total
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:         10 kB\nMemAvailable:    600 kB\n")
    assert host_memory(str(meminfo), str(tmp_path / "no zoneinfo")) == (600 * 1024, 1000 * 1024)
    zoneinfo = tmp_path / "zoneinfo"  # free pages parked on per-CPU lists count as available
    zoneinfo.write_text("Node 0, zone Normal\n  pages free 3\n  pagesets\n    cpu: 0\n      count: 10\n      high: 90\n"
                        "    cpu: 1\n      count: 5\n      high: 90\n")  # fmt: skip
    page = os.sysconf("SC_PAGE_SIZE")
    assert host_memory(str(meminfo), str(zoneinfo)) == (min(600 * 1024 + 15 * page, 1000 * 1024), 1000 * 1024)
    assert 0 < host_memory(str(tmp_path / "absent"))[0]  # sysconf without /proc


@pytest.mark.parametrize(
    ("ids", "runs"),
    [
        ([], []),
        ([3], [(0, 3, 1)]),
        ([4, 5, 6, 9, 2, 3], [(0, 4, 3), (3, 9, 1), (4, 2, 2)]),
        ([1, 1], [(0, 1, 1), (1, 1, 1)]),
    ],
)
def test_consecutive_runs(ids, runs):
    assert consecutive_runs(ids) == runs


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 1024, 1 << 20])  # one block a chunk (slots reused), 3 blocks, all
def test_copy_across_tiers_moves_strided_device_blocks_to_block_major_host_and_back(chunk_bytes):
    device = KVCache(FakeDevice(), LAYOUT, 16 * 1024)  # 1 KiB blocks over 2 layers, k and v
    host = KVCache(FakeDevice(), LAYOUT, 12 * 1024, block_major=True)
    device.buffer.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, (device.buffer.numel() // 2,)))
    original = device.blocks.clone()
    src_ids, dst_ids = [7, 0, 3, 12, 5, 9, 1], [4, 5, 6, 0, 11, 10, 2]  # runs 4-6, 0, 10-11, 2 on the host
    copy_across_tiers(device.blocks, host.blocks, src_ids, dst_ids, outbound=True, chunk_bytes=chunk_bytes)
    for a, b in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(host.blocks[b].view(torch.int16), original[a].view(torch.int16))
    device.buffer.zero_()
    copy_across_tiers(host.blocks, device.blocks, dst_ids, src_ids, outbound=False, chunk_bytes=chunk_bytes)
    for a in range(device.num_blocks):
        expected = original[a] if a in src_ids else torch.zeros_like(original[a])
        assert torch.equal(device.blocks[a].view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64, torch.uint8])  # 6-byte rows, words already, bytes
def test_copy_across_tiers_copies_any_element_size(dtype):
    device = torch.arange(8 * 2 * 3).to(dtype).view(8, 2, 3)
    host = torch.zeros(4, 2, 3, dtype=dtype)
    copy_across_tiers(device, host, [6, 1, 2], [3, 0, 1], outbound=True, chunk_bytes=1 << 20)
    assert torch.equal(host[[3, 0, 1]], device[[6, 1, 2]])
    back = torch.zeros_like(device)
    copy_across_tiers(host, back, [3, 0], [5, 7], outbound=False, chunk_bytes=1)
    assert torch.equal(back[[5, 7]], device[[6, 1]]) and not back[:5].any()


def test_a_migrator_needs_a_positive_chunk_size():
    with pytest.raises(MemoryContractError, match="chunk_bytes must be positive, got 0"):
        TorchMigrator(chunk_bytes=0)


def _caches(num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 4, 2, 8, generator=g).to(torch.bfloat16)


def test_round_trip_device_to_pinned_host_and_back_is_bit_exact():
    device = _caches(6)
    device.view(torch.int16)[0, 0, 0, :3] = torch.tensor([0x7FC1, -1, 0x0001], dtype=torch.int16)  # NaN payloads
    host = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)  # the "pinned_host" tier, simulated on CPU
    original = device.clone()
    migrator = TorchMigrator()
    out = migrator.copy_blocks(device, host, torch.tensor([[0, 3], [5, 0], [2, 1]]))
    out.wait()
    assert out.done()
    device.zero_()
    back = migrator.copy_blocks(host, device, [(3, 0), (0, 5), (1, 2)])
    assert back.done()
    for b in (0, 5, 2):
        assert torch.equal(device[b].view(torch.int16), original[b].view(torch.int16))
    assert torch.count_nonzero(device[1].float()) == 0


def test_freeing_or_overwriting_an_in_flight_block_is_refused():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(2)
    device, host = _caches(4), torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    migrator = TorchMigrator()
    handle = migrator.copy_blocks(device, host, [(blocks[0], 1), (blocks[1], 2)], src_pool=pool)
    assert migrator.in_flight(device, blocks[0]) and migrator.in_flight(host, 2)
    with pytest.raises(MemoryContractError, match="in flight"):
        pool.free([blocks[1]])
    with pytest.raises(MemoryContractError, match="in flight"):
        migrator.copy_blocks(device, host, [(3, 2)])  # writing a block being written
    with pytest.raises(MemoryContractError, match="in flight"):
        migrator.copy_blocks(host, device, [(0, blocks[0])])  # writing a block being read
    assert pool.ref_count(blocks[1]) == 1 and pool.num_free == 2
    handle.wait()
    assert not migrator.in_flight(device, blocks[0])
    pool.free(blocks)
    migrator.copy_blocks(host, device, [(1, blocks[0])]).wait()
    assert pool.num_free == 4


def test_copy_blocks_checks_its_arguments_before_holding_anything():
    pool = BlockPool(4, 4)
    (b,) = pool.allocate(1)
    device, host = _caches(4), torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
    migrator = TorchMigrator()
    with pytest.raises(MemoryContractError, match="out of range"):
        migrator.copy_blocks(device, host, [(b, 9)], src_pool=pool)
    with pytest.raises(MemoryContractError, match="named twice"):
        migrator.copy_blocks(device, host, [(0, 1), (2, 1)])
    with pytest.raises(MemoryContractError, match="caches differ"):
        migrator.copy_blocks(device, host.float(), [(0, 1)])
    with pytest.raises(MemoryContractError, match="is free"):  # the pool refuses a free block; nothing stays held
        migrator.copy_blocks(device, host, [(b, 0), (3, 1)], src_pool=pool)
    assert not migrator.in_flight(host, 0)
    pool.free([b])


def test_malformed_pairs_are_refused():
    with pytest.raises(MemoryContractError, match="pairs must be"):
        TorchMigrator().copy_blocks(_caches(2), _caches(2), [(0, 1, 2)])


# -------------------------------------------------------------------------------------------------
# One allocator per tier and one migrator per runtime
# -------------------------------------------------------------------------------------------------


def test_every_handle_on_a_tier_is_the_same_allocator_so_its_accounts_cover_every_buffer():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    kv = runtime.kv_cache(LAYOUT, 16 * 512)
    again = runtime.allocator()
    assert again is runtime.allocator("device")
    assert again.stats().allocated == 16 * 512 and again.stats().live_buffers == 1  # read through a second handle
    kv.close()
    assert again.stats().allocated == 0


def test_a_second_migrator_handle_cannot_bypass_the_in_flight_guard():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    src, dst = runtime.kv_cache(LAYOUT, 8 * 512), runtime.kv_cache(LAYOUT, 8 * 512, tier="device")
    blocks = src.pool.allocate(2)
    handle = runtime.migrator().copy_blocks(src.blocks, dst.blocks, [(blocks[0], 0), (blocks[1], 1)], src_pool=src.pool)
    assert runtime.migrator() is runtime.migrator()
    with pytest.raises(MemoryContractError, match="in flight in an earlier copy"):
        runtime.migrator().copy_blocks(src.blocks, dst.blocks, [(5, 1)])  # writing a block being written
    handle.wait()
    runtime.migrator().copy_blocks(src.blocks, dst.blocks, [(5, 1)]).wait()
    src.pool.free(blocks)
    src.close()
    dst.close()


def test_a_platform_without_an_allocator_gets_core_default_or_a_clear_error(install_plugin):
    from plugin_factory import healthy

    from vllm_port.errors import PluginError

    install_plugin("bare", healthy("bare"))
    runtime = vllm_port.load(plugins="bare")
    alloc = runtime.allocator()
    assert isinstance(alloc, HostMemoryAllocator) and alloc.name == "host allocator (core's default)"
    install_plugin(
        "chip",
        healthy(
            "chip",
            extra="@hookimpl\ndef vllm_port_platform_describe():\n"
            "    return PlatformDescription(name='chip', device_type='mtia', priority=1, dist_backend='gloo')\n",
        ),
    )
    with pytest.raises(
        PluginError, match="platform 'chip' has no allocator: .* not 'mtia'; implement vllm_port_allocator"
    ):
        vllm_port.load(plugins="chip").allocator()
