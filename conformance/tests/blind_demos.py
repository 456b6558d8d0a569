"""Each blind plugin's bug, shown on one small valid input against the op's float64 reference.

For every op provider of :data:`blind_plugins.BLIND`, ``demonstrate_<provider>()`` builds one
small input the contract allows, runs the buggy provider (in the dtype it claims) and the op's
reference (in float64 on the same values), and returns the largest absolute difference over every
output and in-place argument: for value ops far past the op's tolerance (1e-5 to 2e-2), for
``sample`` the largest difference of drawn token ids (the contract allows none). :data:`DEMOS` maps
each provider's name to its demonstration; :data:`MEMORY_DEMOS` does the same for the memory parts,
which run in one process, and :data:`COMM_DEMOS` for the comm parts, each on two gloo ranks of
fresh processes on this host against core's ``TorchCollectives``. Run ``python blind_demos.py`` to
print them all.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm_port.comm import TorchCollectives
from vllm_port.ops import make_cos_sin_cache
from vllm_port.ops.activation import gelu_and_mul_reference, silu_and_mul_reference
from vllm_port.ops.attention import (
    paged_attention_reference,
    prefill_attention_reference,
    reshape_and_cache_reference,
)
from vllm_port.ops.linear import embedding_reference, linear_reference
from vllm_port.ops.norm import fused_add_rms_norm_reference, rms_norm_reference
from vllm_port.ops.rotary import rotary_embedding_reference
from vllm_port.ops.sampling import sample_reference

__all__ = ["COMM_DEMOS", "DEMOS", "MEMORY_DEMOS", "plugin_module"]

F64 = torch.float64


def _blind_plugins() -> ModuleType:
    """The sibling module ``blind_plugins``, however this directory is imported (package or path)."""
    if __package__:
        from . import blind_plugins  # type: ignore[import-not-found]

        return blind_plugins
    name = "blind_plugins"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("blind_plugins.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@cache
def plugin_module(name: str) -> ModuleType:
    """The module of blind plugin ``name``, executed from its source string."""
    plugin = next(p for p in _blind_plugins().BLIND if p.name == name)
    module = ModuleType(f"vllm_port_{name.replace('-', '_')}_demo")
    exec(compile(plugin.source, f"<{name}>", "exec"), module.__dict__)  # our own plugin source
    return module


def _kernel(provider_name: str) -> Callable[..., Any]:
    providers = plugin_module("blind-ops").PROVIDERS
    return next(p.fn for p in providers if p.name == provider_name)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _diff(*pairs: tuple[torch.Tensor, torch.Tensor]) -> float:
    return max(float((got.to(F64) - want.to(F64)).abs().max()) for got, want in pairs)


# -------------------------------------------------------------------------------------------------
# embedding
# -------------------------------------------------------------------------------------------------


def demonstrate_blind_embedding_last_row() -> float:
    weight = _randn(10, 8)
    ids = torch.tensor([0, 9, 3])  # 9: the last vocabulary row
    return _diff((_kernel("blind_embedding_last_row")(ids, weight), embedding_reference(ids, weight.to(F64))))


def demonstrate_blind_embedding_shard_offset() -> float:
    full = _randn(20, 8, dtype=torch.bfloat16)
    shard = full[10:]  # rank 1's rows of a vocabulary-parallel table
    ids = torch.tensor([0, 1, 2])
    return _diff((_kernel("blind_embedding_shard_offset")(ids, shard), embedding_reference(ids, shard.to(F64))))


# -------------------------------------------------------------------------------------------------
# rms_norm, fused_add_rms_norm
# -------------------------------------------------------------------------------------------------


def demonstrate_blind_rms_norm_tail_tile() -> float:
    x, w = _randn(2, 320), _randn(320, seed=1)  # 320 = 256 + a 64-wide tail
    return _diff((_kernel("blind_rms_norm_tail_tile")(x, w, 1e-6), rms_norm_reference(x.to(F64), w.to(F64), 1e-6)))


def demonstrate_blind_rms_norm_view_offset() -> float:
    buf, w = _randn(3, 64, dtype=torch.bfloat16), _randn(64, dtype=torch.bfloat16, seed=1)
    x = buf[1:]  # rows 1 and 2: a view at storage offset 64
    got = _kernel("blind_rms_norm_view_offset")(x, w, 1e-6)
    return _diff((got, rms_norm_reference(x.to(F64), w.to(F64), 1e-6)))


def _fused_add(provider_name: str, rows: int, dtype: torch.dtype) -> float:
    x, residual, w = (
        _randn(rows, 64, dtype=dtype),
        _randn(rows, 64, dtype=dtype, seed=1),
        _randn(64, dtype=dtype, seed=2),
    )
    mine, theirs = residual.clone(), residual.to(F64)
    got = _kernel(provider_name)(x, mine, w, 1e-6)
    want = fused_add_rms_norm_reference(x.to(F64), theirs, w.to(F64), 1e-6)
    return _diff((got, want), (mine, theirs))


def demonstrate_blind_fused_add_persistent_rows() -> float:
    return _fused_add("blind_fused_add_persistent_rows", 80, torch.float32)  # 80 rows: past one grid of 64


def demonstrate_blind_fused_add_decode_row() -> float:
    return _fused_add("blind_fused_add_decode_row", 1, torch.float16)  # one decode token


# -------------------------------------------------------------------------------------------------
# rotary_embedding
# -------------------------------------------------------------------------------------------------


def _rotary(provider_name: str, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head: int, table) -> float:
    mine_q, mine_k, want_q, want_k = q.clone(), k.clone(), q.to(F64), k.to(F64)
    _kernel(provider_name)(positions, mine_q, mine_k, head, table, True)
    rotary_embedding_reference(positions, want_q, want_k, head, table.to(F64), True)
    return _diff((mine_q, want_q), (mine_k, want_k))


def demonstrate_blind_rotary_table_ring() -> float:
    table = make_cos_sin_cache(16384, 64)
    positions = torch.tensor([5, 9000, 16383])  # 9000 and 16383: past 8k
    return _rotary("blind_rotary_table_ring", positions, _randn(3, 128), _randn(3, 64, seed=1), 64, table)


def demonstrate_blind_rotary_last_row() -> float:
    table = make_cos_sin_cache(1024, 64)
    positions = torch.tensor([1023, 17, 0])  # 1023: the table's last row
    return _rotary("blind_rotary_last_row", positions, _randn(3, 128), _randn(3, 64, seed=1), 64, table)


def demonstrate_blind_rotary_3d_heads() -> float:
    table = make_cos_sin_cache(64, 32)
    q, k = _randn(4, 4, 32, dtype=torch.bfloat16), _randn(4, 2, 32, dtype=torch.bfloat16, seed=1)  # 3-D
    return _rotary("blind_rotary_3d_heads", torch.tensor([1, 2, 3, 4]), q, k, 32, table)


def demonstrate_blind_rotary_positions_offset() -> float:
    table = make_cos_sin_cache(128, 32)
    upload = torch.tensor([40, 50, 60, 1, 2, 3])  # one int64 upload: token ids, then positions
    positions = upload[3:]
    q, k = _randn(3, 64, dtype=torch.float16), _randn(3, 32, dtype=torch.float16, seed=1)
    return _rotary("blind_rotary_positions_offset", positions, q, k, 32, table)


# -------------------------------------------------------------------------------------------------
# silu_and_mul, gelu_and_mul
# -------------------------------------------------------------------------------------------------


def demonstrate_blind_silu_leading_dims() -> float:
    x = _randn(2, 3, 16)  # [batch, tokens, 2d]
    return _diff((_kernel("blind_silu_leading_dims")(x), silu_and_mul_reference(x.to(F64))))


def demonstrate_blind_gelu_tail_tile() -> float:
    x = _randn(2, 192, dtype=torch.float16)  # d = 96: one tile of 64 and a tail of 32
    return _diff((_kernel("blind_gelu_tail_tile")(x), gelu_and_mul_reference(x.to(F64))))


# -------------------------------------------------------------------------------------------------
# linear
# -------------------------------------------------------------------------------------------------


def demonstrate_blind_linear_gemv_bias() -> float:
    x, w, b = _randn(1, 32), _randn(16, 32, seed=1), _randn(16, seed=2)  # one row
    return _diff((_kernel("blind_linear_gemv_bias")(x, w, b), linear_reference(x.to(F64), w.to(F64), b.to(F64))))


def demonstrate_blind_linear_k_tail() -> float:
    x, w = _randn(2, 320, dtype=torch.bfloat16), _randn(8, 320, dtype=torch.bfloat16, seed=1)  # K = 256 + 64
    return _diff((_kernel("blind_linear_k_tail")(x, w), linear_reference(x.to(F64), w.to(F64))))


def demonstrate_blind_linear_a_offset() -> float:
    buf, w = _randn(3, 32, dtype=torch.float16), _randn(8, 32, dtype=torch.float16, seed=1)
    x = buf[1:]  # a view at storage offset 32
    return _diff((_kernel("blind_linear_a_offset")(x, w), linear_reference(x.to(F64), w.to(F64))))


# -------------------------------------------------------------------------------------------------
# reshape_and_cache
# -------------------------------------------------------------------------------------------------


def _cache(provider_name: str, kv_heads: int, head: int, slots: torch.Tensor, dtype: torch.dtype) -> float:
    n = slots.shape[0]
    key, value = _randn(n, kv_heads, head, dtype=dtype), _randn(n, kv_heads, head, dtype=dtype, seed=1)
    shape = (4, 4, kv_heads, head)
    mine = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    want = (torch.zeros(shape, dtype=F64), torch.zeros(shape, dtype=F64))
    _kernel(provider_name)(key, value, *mine, slots)
    reshape_and_cache_reference(key.to(F64), value.to(F64), *want, slots)
    return _diff((mine[0], want[0]), (mine[1], want[1]))


def demonstrate_blind_cache_int32_slots() -> float:
    return _cache("blind_cache_int32_slots", 2, 8, torch.tensor([0, 5, 9, 14], dtype=torch.int32), torch.float32)


def demonstrate_blind_cache_row_block() -> float:
    return _cache("blind_cache_row_block", 32, 128, torch.tensor([0, 1, 5]), torch.bfloat16)  # 32 x 128 = 4096 wide


def demonstrate_blind_cache_slots_offset() -> float:
    upload = torch.tensor([7, 2, 5, 0, 1, 2, 0, 1, 2])  # one int64 upload: ids, positions, slots
    return _cache("blind_cache_slots_offset", 2, 8, upload[6:], torch.float16)


# -------------------------------------------------------------------------------------------------
# paged_attention
# -------------------------------------------------------------------------------------------------


def _decode(provider_name: str, query, key_cache, value_cache, tables, lens, scale, window=0, cap=0.0) -> float:
    got = _kernel(provider_name)(query, key_cache, value_cache, tables, lens, scale, window, cap)
    want = paged_attention_reference(
        query.to(F64), key_cache.to(F64), value_cache.to(F64), tables, lens, scale, window, cap
    )
    return _diff((got, want))


def demonstrate_blind_decode_int64_tables() -> float:
    caches = _randn(6, 4, 2, 16), _randn(6, 4, 2, 16, seed=1)
    tables = torch.tensor([[2, 4, 1], [5, 0, 3]], dtype=torch.int64)
    lens = torch.tensor([10, 9], dtype=torch.int32)
    return _decode("blind_decode_int64_tables", _randn(2, 4, 16, seed=2), *caches, tables, lens, 0.25)


def demonstrate_blind_decode_cap_after_window() -> float:
    caches = _randn(4, 4, 1, 16, dtype=torch.bfloat16), _randn(4, 4, 1, 16, dtype=torch.bfloat16, seed=1)
    tables, lens = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32), torch.tensor([16], dtype=torch.int32)
    query = _randn(1, 2, 16, dtype=torch.bfloat16, seed=2)
    # window 2 of 16 keys, cap 1: the 14 keys outside the window should weigh nothing
    return _decode("blind_decode_cap_after_window", query, *caches, tables, lens, 0.25, 2, 1.0)


def demonstrate_blind_decode_null_last_block() -> float:
    caches = _randn(4, 4, 1, 16), _randn(4, 4, 1, 16, seed=1)
    tables, lens = torch.tensor([[3, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)  # 3: the last block
    return _decode("blind_decode_null_last_block", _randn(1, 2, 16, seed=2), *caches, tables, lens, 0.25)


def demonstrate_blind_decode_value_offset() -> float:
    kv = _randn(4, 2, 4, 1, 16, dtype=torch.float16)  # [blocks, K/V, block_size, kv_heads, head_size]
    tables, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)
    query = _randn(1, 2, 16, dtype=torch.float16, seed=2)
    return _decode("blind_decode_value_offset", query, kv[:, 0], kv[:, 1], tables, lens, 0.25)


def demonstrate_blind_decode_split_kv() -> float:
    query = _randn(1, 1, 16, seed=2)
    keys, values = _randn(40, 16, 1, 16), _randn(40, 16, 1, 16, seed=1)
    keys.view(-1, 16)[512:600] = query[0, 0]  # the keys of the partial last partition match the query best
    values.view(-1, 16)[512:600] = 4.0
    tables, lens = torch.arange(40, dtype=torch.int32)[None, :], torch.tensor([600], dtype=torch.int32)
    return _decode("blind_decode_split_kv", query, keys, values, tables, lens, 0.5)  # a batch of one sequence


# -------------------------------------------------------------------------------------------------
# prefill_attention
# -------------------------------------------------------------------------------------------------


def _prefill(provider_name: str, query, caches, tables, cu, lens, max_q, window=0, cap=0.0) -> float:
    got = _kernel(provider_name)(query, *caches, tables, cu, lens, max_q, 0.25, window, cap)
    want = prefill_attention_reference(
        query.to(F64), caches[0].to(F64), caches[1].to(F64), tables, cu, lens, max_q, 0.25, window, cap
    )
    return _diff((got, want))


def demonstrate_blind_prefill_int64_lens() -> float:
    caches = _randn(4, 4, 1, 16, dtype=torch.bfloat16), _randn(4, 4, 1, 16, dtype=torch.bfloat16, seed=1)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int64)
    query = _randn(12, 2, 16, dtype=torch.bfloat16, seed=2)
    return _prefill("blind_prefill_int64_lens", query, caches, tables, cu, lens, 7)


def demonstrate_blind_prefill_cap_drops_window() -> float:
    caches = _randn(4, 4, 1, 16), _randn(4, 4, 1, 16, seed=1)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    cu, lens = torch.tensor([0, 12], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    return _prefill("blind_prefill_cap_drops_window", _randn(12, 2, 16, seed=2), caches, tables, cu, lens, 12, 4, 10.0)


def demonstrate_blind_prefill_tile_causal() -> float:
    caches = _randn(5, 16, 1, 16, dtype=torch.float16), _randn(5, 16, 1, 16, dtype=torch.float16, seed=1)
    tables = torch.arange(5, dtype=torch.int32)[None, :]
    cu, lens = torch.tensor([0, 80], dtype=torch.int32), torch.tensor([80], dtype=torch.int32)  # 80 query rows
    query = _randn(80, 2, 16, dtype=torch.float16, seed=2)
    return _prefill("blind_prefill_tile_causal", query, caches, tables, cu, lens, 80)


# -------------------------------------------------------------------------------------------------
# sample (the difference is in token ids: the contract allows none)
# -------------------------------------------------------------------------------------------------

ROWS, VOCAB = 64, 64


def _sample(provider_name: str, logits, top_k, top_p=None, seeds=None) -> float:
    temperature = torch.ones(ROWS)
    top_p = torch.ones(ROWS) if top_p is None else top_p
    seeds = torch.arange(1, ROWS + 1, dtype=torch.int64) if seeds is None else seeds
    got = _kernel(provider_name)(logits, temperature, top_k, top_p, seeds)
    want = sample_reference(logits.to(F64), temperature, top_k, top_p, seeds)
    return _diff((got, want))


def demonstrate_blind_sample_top_k_minus_one() -> float:
    logits = _randn(ROWS, VOCAB)
    return _sample("blind_sample_top_k_minus_one", logits, torch.full((ROWS,), -1))  # the engine's default top_k


def demonstrate_blind_sample_top_p_one_skips() -> float:
    logits = _randn(ROWS, VOCAB, dtype=torch.bfloat16)
    return _sample("blind_sample_top_p_one_skips", logits, torch.full((ROWS,), 1))  # top_k 1 at top_p 1.0


def demonstrate_blind_sample_seeds_offset() -> float:
    logits = _randn(ROWS, VOCAB, dtype=torch.float16)
    upload = torch.cat([torch.full((ROWS,), -1), torch.arange(1000, 1000 + ROWS)])  # one int64 upload: top_k, seeds
    return _sample("blind_sample_seeds_offset", logits, upload[:ROWS], seeds=upload[ROWS:])


def demonstrate_blind_sample_int32_top_k() -> float:
    logits = _randn(ROWS, VOCAB)
    return _sample("blind_sample_int32_top_k", logits, torch.full((ROWS,), 1, dtype=torch.int32))


# -------------------------------------------------------------------------------------------------
# memory parts
# -------------------------------------------------------------------------------------------------


def _migrate(plugin: str, migrator_class: str, pairs: list[tuple[int, int]], blocks: int) -> float:
    src = _randn(blocks, 2, 4, 8)
    dst = torch.zeros_like(src)
    getattr(plugin_module(plugin), migrator_class)().copy_blocks(src, dst, pairs).wait()
    a, b = zip(*pairs, strict=True)
    return _diff((dst[list(b)], src[list(a)]))


def demonstrate_blind_migrator_ring() -> float:
    return _migrate("blind-migrator-ring", "DescriptorRingMigrator", [(i, i) for i in range(100)], 128)  # 100 > 64


def demonstrate_blind_migrator_last() -> float:
    return _migrate("blind-migrator-last", "GuardedMigrator", [(0, 7), (7, 3)], 8)  # block 7: the pool's last


def demonstrate_blind_allocator_arena() -> float:
    allocator = plugin_module("blind-allocator-arena").ArenaAllocator()
    size = 9 << 20  # 9 MiB: 4.5 huge pages
    first, second = allocator.allocate(size), allocator.allocate(size)
    first.fill_(1)
    second.fill_(2)  # the next buffer's start overwrites the first one's last 1 MiB
    wrong = float((first.to(F64) - 1).abs().max())
    allocator.free(first)
    allocator.free(second)
    return wrong


# -------------------------------------------------------------------------------------------------
# comm parts: two gloo ranks, the blind part against core's TorchCollectives on the same tensors
# -------------------------------------------------------------------------------------------------


def _int64_sum_input(rank: int) -> torch.Tensor:
    return torch.tensor([10**12 + 7 * rank, 2**24 + 1, 3], dtype=torch.int64)  # sums far above 2^24


def _past_64k_input(rank: int) -> torch.Tensor:
    return _randn(16384 + 100, seed=rank)  # 64 KiB + 400 bytes of float32


def _odd_count_input(rank: int) -> torch.Tensor:
    return _randn(257, seed=rank)  # 1028 bytes: an odd float32 count on the bulk path


#: plugin -> (its Collectives class, the call, each rank's input)
_COMM_CASES: dict[str, tuple[str, str, Callable[[int], torch.Tensor]]] = {
    "blind-comm-int64": ("FloatEngineCollectives", "all_reduce", _int64_sum_input),
    "blind-comm-64k": ("ChunkedRingCollectives", "all_reduce", _past_64k_input),
    "blind-comm-odd": ("WordBulkCollectives", "all_gather", _odd_count_input),
}


def _comm_rank(rank: int, port: int, plugin: str, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        cls, call, make = _COMM_CASES[plugin]
        blind, core = getattr(plugin_module(plugin), cls)(), TorchCollectives()
        got, want = getattr(blind, call)(make(rank)), getattr(core, call)(make(rank))
        results.put(_diff((got, want)))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(plugin: str) -> float:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_comm_rank, args=(rank, port, plugin, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    diffs = [results.get(timeout=300) for _ in ranks]
    for process in ranks:
        process.join(timeout=60)
    return max(diffs)


def demonstrate_blind_comm_int64() -> float:
    return _two_ranks("blind-comm-int64")


def demonstrate_blind_comm_64k() -> float:
    return _two_ranks("blind-comm-64k")


def demonstrate_blind_comm_odd() -> float:
    return _two_ranks("blind-comm-odd")


#: provider name -> its demonstration, for every op bug of the blind-ops plugin (a missing one fails here)
DEMOS: dict[str, Callable[[], float]] = {
    bug.part: globals()[f"demonstrate_{bug.part}"]
    for plugin in _blind_plugins().BLIND
    if plugin.name == "blind-ops"
    for bug in plugin.bugs
}

#: memory part's plugin name -> its demonstration
MEMORY_DEMOS: dict[str, Callable[[], float]] = {
    "blind-migrator-ring": demonstrate_blind_migrator_ring,
    "blind-migrator-last": demonstrate_blind_migrator_last,
    "blind-allocator-arena": demonstrate_blind_allocator_arena,
}

#: comm part's plugin name -> its demonstration (two processes)
COMM_DEMOS: dict[str, Callable[[], float]] = {
    "blind-comm-int64": demonstrate_blind_comm_int64,
    "blind-comm-64k": demonstrate_blind_comm_64k,
    "blind-comm-odd": demonstrate_blind_comm_odd,
}


if __name__ == "__main__":
    for label, fn in [*DEMOS.items(), *MEMORY_DEMOS.items(), *COMM_DEMOS.items()]:
        print(f"{label:40s} {fn():.4g}")
