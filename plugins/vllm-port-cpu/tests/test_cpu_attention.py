"""The CPU paged-cache providers on the edges the op samples leave out: padded tables, empty sequences, skips."""

import pytest
import torch

from vllm_port.ops import paged_attention, prefill_attention, reshape_and_cache
from vllm_port_cpu import attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
by_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


def paged_batch(seq_lens, dtype, *, kv_heads=2, head_size=32, block_size=8, extra_columns=0, index_dtype=torch.int32):
    """NaN caches holding random K/V where the sequences own slots; tables padded with a NaN block."""
    gen = torch.Generator().manual_seed(sum(seq_lens))
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache, value_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    tables = torch.full((len(seq_lens), max(need) + extra_columns), int(order[-1]), dtype=index_dtype)
    used = 0
    for i, n in enumerate(seq_lens):
        tables[i, : need[i]] = order[used : used + need[i]]
        for t in range(n):
            block, offset = int(tables[i, t // block_size]), t % block_size
            key_cache[block, offset] = torch.randn(kv_heads, head_size, generator=gen)
            value_cache[block, offset] = torch.randn(kv_heads, head_size, generator=gen)
        used += need[i]
    return key_cache.to(dtype), value_cache.to(dtype), tables, torch.tensor(seq_lens, dtype=index_dtype)


@by_dtype
@pytest.mark.parametrize(
    ("window", "cap"),
    [(0, 0.0), (5, 0.0), (100, 0.0), (0, 10.0), (6, 20.0)],
    ids=["plain", "window", "wide window", "cap", "both"],
)
def test_decode_over_tables_padded_far_past_the_longest_sequence(dtype, window, cap):
    kc, vc, tables, lens = paged_batch([1, 7, 8, 9, 30], dtype, extra_columns=16, index_dtype=torch.int64)
    q = torch.randn(5, 8, 32, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = (q, kc, vc, tables, lens, 32**-0.5, window, cap)
    assert paged_attention.check(attention.paged_attention.fn, args, dtype) is None


@by_dtype
@pytest.mark.parametrize(
    ("window", "cap"), [(0, 0.0), (4, 0.0), (0, 15.0), (3, 25.0)], ids=["plain", "window", "cap", "both"]
)
def test_prefill_with_an_empty_sequence_prefixes_and_a_loose_max_query_len(dtype, window, cap):
    q_lens, prefixes = [5, 0, 1, 12], [3, 9, 20, 0]
    kc, vc, tables, lens = paged_batch([q + p for q, p in zip(q_lens, prefixes, strict=True)], dtype, extra_columns=3)
    cu = torch.tensor([0, 5, 5, 6, 18], dtype=torch.int32)
    q = torch.randn(18, 4, 32, generator=torch.Generator().manual_seed(5)).to(dtype)
    args = (q, kc, vc, tables, cu, lens, 16, 32**-0.5, window, cap)
    assert prefill_attention.check(attention.prefill_attention.fn, args, dtype) is None


def test_prefill_of_one_token_per_sequence_equals_decode():
    kc, vc, tables, lens = paged_batch([4, 17, 33], torch.float32, kv_heads=1)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(6))
    cu = torch.arange(4, dtype=torch.int32)
    prefill = attention.prefill_attention.fn(q, kc, vc, tables, cu, lens, 1, 0.2)
    decode = attention.paged_attention.fn(q, kc, vc, tables, lens, 0.2)
    torch.testing.assert_close(prefill, decode)


def identical(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def run_cache_write(slots, dtype=torch.bfloat16):
    """The provider's and the reference's writes into NaN-poisoned caches: (provider caches, reference caches)."""
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(len(slots), 2, 16, generator=gen).to(dtype)
    v = torch.randn(len(slots), 2, 16, generator=gen).to(dtype)
    caches = torch.randn(2, 4, 8, 2, 16, generator=gen).to(dtype)
    caches[:, :, :3] = float("nan")  # slot 0 among them
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    got, want = caches.clone(), caches.clone()
    attention.reshape_and_cache.fn(k, v, got[0], got[1], slot_mapping)
    reshape_and_cache.reference(k, v, want[0], want[1], slot_mapping)
    return got, want


@pytest.mark.parametrize(
    "slots",
    [[-1, -1, -1], [], [-1, 0, -1, 9], [5, -1, 0, 31], [-1, -1, 17]],
    ids=["all skipped", "no tokens", "skips around slot 0", "skip between writes", "only the last kept"],
)
def test_cache_writes_skip_minus_one_and_touch_nothing_else(slots):
    got, want = run_cache_write(slots)
    assert identical(got, want)


@pytest.mark.parametrize("cap", [0.0, 30.0], ids=["sdpa", "soft cap"])
def test_decode_of_an_empty_sequence_gives_zeros_like_the_reference(cap):
    kc, vc, tables, lens = paged_batch([6, 11], torch.float32)
    lens[1] = 0  # its blocks now hold K/V no query may see
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(8))
    args = (q, kc, vc, tables, lens, 0.2, 0, cap)
    assert paged_attention.check(attention.paged_attention.fn, args, torch.float32) is None
    assert not bool(attention.paged_attention.fn(*args)[1].any())


@pytest.mark.parametrize("cap", [0.0, 30.0], ids=["sdpa", "soft cap"])
def test_padded_sequences_read_nothing_of_their_stale_block_tables(cap):
    """seq_lens 0 is graph capture's padding: zero rows, whatever the padded rows of the table hold (here: no block)."""
    kc, vc, tables, lens = paged_batch([6, 11, 9], torch.bfloat16, extra_columns=1)
    lens[1] = 0
    tables[1] = 10**6  # a stale entry far outside the cache: reading it would raise
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    args = (q, kc, vc, tables, lens, 0.2, 0, cap)
    assert paged_attention.check(attention.paged_attention.fn, args, torch.bfloat16) is None
    # prefill: the padded sequence owns two padding tokens
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    q = torch.randn(9, 4, 32, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    args = (q, kc, vc, tables, cu, lens, 4, 0.2, 0, cap)
    assert prefill_attention.check(attention.prefill_attention.fn, args, torch.bfloat16) is None
    assert not bool(attention.prefill_attention.fn(*args)[3:5].any())
