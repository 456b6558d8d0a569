"""The KV-cache builder and the default migrator, on CPU."""

import pytest
import torch

import vllm_port
from vllm_port.kv_pool import BlockPool
from vllm_port.memory import (
    Allocator,
    KVCache,
    KVLayout,
    MemoryContractError,
    OutOfMemoryError,
    TorchMigrator,
    default_block_pool_factory,
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
