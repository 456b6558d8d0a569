"""The native attention kernels (``vllm_port_cpu.native``) against the float64 reference, and their build and fallback.

The op samples run on every CPU provider in ``test_cpu_ops.py``; here: the shapes that matter to the
kernel's own loops (GQA groups, windows and caps across chunk and block boundaries, padded rows,
strided caches), its argument checks, and what happens without a compiler or with the kernels off.
"""

import hashlib

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import ALL_OPS, BindContext, OpRegistry, paged_attention, prefill_attention, reshape_and_cache
from vllm_port_cpu import native, ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
by_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
needs_kernels = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.status}")


def paged_batch(seq_lens, dtype, *, kv_heads=2, head_size=64, block_size=16, interleaved=False, seed=0, spare=1):
    """Caches of NaN but where the sequences own slots (random K/V), blocks scattered, tables padded with a NaN block.

    With ``interleaved`` the caches are ``kv[:, 0]`` and ``kv[:, 1]`` of one buffer (strided views).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen)
    kv = torch.full((num_blocks, 2, block_size, kv_heads, head_size), float("nan"))
    tables = torch.full((len(seq_lens), max(need) + spare), int(order[-1]), dtype=torch.int32)
    used = 0
    for i, n in enumerate(seq_lens):
        tables[i, : need[i]] = order[used : used + need[i]].to(torch.int32)
        used += need[i]
        for b in range(need[i]):
            rows = min(block_size, n - b * block_size)
            kv[int(tables[i, b]), :, :rows] = torch.randn(2, rows, kv_heads, head_size, generator=gen)
    kv = kv.to(dtype)
    if interleaved:
        return kv[:, 0], kv[:, 1], tables, torch.tensor(seq_lens, dtype=torch.int32)
    return kv[:, 0].contiguous(), kv[:, 1].contiguous(), tables, torch.tensor(seq_lens, dtype=torch.int32)


def queries(tokens, heads, head_size, dtype, seed=1, sharp=1.0):
    return (sharp * torch.randn(tokens, heads, head_size, generator=torch.Generator().manual_seed(seed))).to(dtype)


# contexts around the kernel's 64-key chunks and 16-token blocks; 0 is a padded sequence
LENS = [1, 15, 16, 17, 63, 64, 65, 0, 130]


@needs_kernels
@by_dtype
# a group's rows share each V row in blocks of 4, then 3, 2 or 1 rows: groups 3 and 7 take the 3-row block
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(2, 2), (6, 2), (8, 2), (7, 1), (8, 1)], ids=["gqa 1", "gqa 3", "gqa 4", "gqa 7", "gqa 8"]
)
@pytest.mark.parametrize(
    ("window", "cap"), [(0, 0.0), (20, 0.0), (0, 5.0), (70, 30.0)], ids=["plain", "window", "cap", "both"]
)
def test_decode_matches_the_float64_reference(dtype, heads, kv_heads, window, cap):
    kc, vc, tables, lens = paged_batch(LENS, dtype, kv_heads=kv_heads)
    q = queries(len(LENS), heads, 64, dtype, sharp=3.0 if cap else 1.0)
    args = (q, kc, vc, tables, lens, 64**-0.5, window, cap)
    assert paged_attention.check(native.paged_attention.fn, args, dtype) is None
    assert not bool(native.paged_attention.fn(*args)[LENS.index(0)].any())  # exact zeros, not NaN


@needs_kernels
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (9, 0.0), (0, 5.0)], ids=["plain", "window", "cap"])
def test_a_non_finite_element_read_as_stored_gives_what_the_reference_gives(bad, where, window, cap):
    """bfloat16 at head 64 reads rows as stored (vdpbf16ps where the CPU has it), at decode and in a prefill tile of
    one token: a NaN or infinity in one K or V element gives the float64 reference's NaN or infinity (the op's
    check refuses any NaN, so this compares with the reference directly), and the other sequences stay finite."""
    kc, vc, tables, lens = paged_batch(LENS, torch.bfloat16, kv_heads=2)
    (kc if where == "key" else vc)[int(tables[LENS.index(17), 0]), 3, 1, 7] = bad  # its 4th token, KV head 1
    q = queries(len(LENS), 6, 64, torch.bfloat16)
    wide = (q.double(), kc.double(), vc.double(), tables, lens, 64**-0.5, window, cap)
    want = paged_attention.reference(*wide)
    got = native.paged_attention.fn(q, kc, vc, tables, lens, 64**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want, atol=0.015, rtol=0.02, equal_nan=True)
    assert bool(got[[i for i, n in enumerate(LENS) if n != 17]].isfinite().all())
    cu = torch.tensor([0, *torch.tensor(LENS).clamp(max=1).cumsum(0).tolist()], dtype=torch.int32)
    one = q[torch.tensor(LENS) > 0]  # a prefill of one token a sequence (none for the padded one)
    got = native.prefill_attention.fn(one, kc, vc, tables, cu, lens, 1, 64**-0.5, window, cap)
    torch.testing.assert_close(got.double(), want[torch.tensor(LENS) > 0], atol=0.015, rtol=0.02, equal_nan=True)


@needs_kernels
@pytest.mark.parametrize("cap", [1e4, 1e6, 1e9, 1e-50], ids=lambda c: f"cap {c:g}")
def test_soft_caps_far_above_or_below_the_scores_match_the_float64_reference(cap):
    """tanh's (1 - e) / (1 + e) cancels when the cap dwarfs the scores (a cap of 1e6 was 1e-2 off in float32, one
    of 1e9 attended uniformly); a cap under float32's smallest value would reach the kernel as 0, no cap at all."""
    kc, vc, tables, lens = paged_batch(LENS, torch.float32)
    q = queries(len(LENS), 8, 64, torch.float32, sharp=3.0)
    assert (
        paged_attention.check(native.paged_attention.fn, (q, kc, vc, tables, lens, 0.125, 0, cap), torch.float32)
        is None
    )
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    q = queries(sum(LENS), 8, 64, torch.float32, sharp=3.0)
    args = (q, kc, vc, tables, cu, lens, max(LENS), 0.125, 0, cap)
    assert prefill_attention.check(native.prefill_attention.fn, args, torch.float32) is None


@needs_kernels
@by_dtype
# a tile's rows (its tokens x the group) lie across 16 * k vector lanes, taken in slabs of 64, 32 and 16:
# groups 3 and 7 make tiles of 48 and 112 lanes (32 + 16 and 64 + 32 + 16)
@pytest.mark.parametrize(
    ("heads", "kv_heads"),
    [(2, 2), (8, 2), (8, 1), (6, 2), (7, 1)],
    ids=["gqa 1", "gqa 4", "gqa 8", "gqa 3", "gqa 7"],
)
@pytest.mark.parametrize(("window", "cap"), [(0, 0.0), (9, 0.0), (0, 5.0)], ids=["plain", "window", "cap"])
def test_prefill_matches_the_float64_reference(dtype, heads, kv_heads, window, cap):
    # new tokens after cached prefixes (chunked prefill), tiles of 16 queries cut mid-sequence, a padded
    # sequence owning two padding tokens, a sequence with no new token
    q_lens, prefixes = [1, 17, 40, 2, 0, 5], [0, 16, 30, 0, 9, 70]
    seq_lens = [q + p for q, p in zip(q_lens, prefixes, strict=True)]
    seq_lens[3] = 0
    kc, vc, tables, lens = paged_batch(seq_lens, dtype, kv_heads=kv_heads)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = queries(sum(q_lens), heads, 64, dtype, sharp=3.0 if cap else 1.0)
    args = (q, kc, vc, tables, cu, lens, max(q_lens), 64**-0.5, window, cap)
    assert prefill_attention.check(native.prefill_attention.fn, args, dtype) is None
    assert not bool(native.prefill_attention.fn(*args)[58:60].any())  # the padded sequence's tokens


@needs_kernels
# 40: not a multiple of 16; 80: of 16, not of 32 (a bfloat16 decode widens its rows); 96, 128: read as stored
@pytest.mark.parametrize("head_size", [40, 80, 96, 128], ids=lambda d: f"head {d}")
def test_strided_caches_and_head_sizes_run_in_place(head_size, monkeypatch):
    kc, vc, tables, lens = paged_batch(
        [5, 33, 100], torch.bfloat16, head_size=head_size, block_size=8, interleaved=True
    )
    assert not kc.is_contiguous()
    q = queries(3, 4, head_size, torch.bfloat16)
    # the torch provider must not be asked: the kernel reads the views by their strides
    monkeypatch.setattr(native, "attention", None)
    args = (q, kc, vc, tables, lens, 0.3)
    assert paged_attention.check(native.paged_attention.fn, args, torch.bfloat16) is None
    cu = torch.arange(4, dtype=torch.int32)
    prefill = native.prefill_attention.fn(q, kc, vc, tables, cu, lens, 1, 0.3)
    torch.testing.assert_close(prefill, native.paged_attention.fn(*args), rtol=0, atol=0)
    cu = torch.tensor([0, 5, 25, 45], dtype=torch.int32)  # prefill tiles: all of the first, then chunked
    q = queries(45, 4, head_size, torch.bfloat16)
    args = (q, kc, vc, tables, cu, lens, 20, 0.3)
    assert prefill_attention.check(native.prefill_attention.fn, args, torch.bfloat16) is None


@needs_kernels
def test_layouts_the_kernel_does_not_cover_go_to_the_torch_provider():
    kc, vc, tables, lens = paged_batch([5, 20], torch.float32)
    q = queries(2, 4, 64, torch.float32)
    columns = torch.full((2, 4, 128), float("nan"))[..., ::2]  # last dimension not contiguous
    columns.copy_(q)
    args = (columns, kc, vc, tables, lens, 0.125)
    assert paged_attention.check(native.paged_attention.fn, args, torch.float32) is None
    doubles = (q.double(), kc.double(), vc.double(), tables, lens, 0.125)
    torch.testing.assert_close(native.paged_attention.fn(*doubles), paged_attention.reference(*doubles))


@needs_kernels
def test_out_of_range_tables_and_lengths_raise_instead_of_reading_memory():
    # the kernel's own checks (with value validation on, the op's input check raises first, naming the same argument)
    kc, vc, tables, lens = paged_batch([5, 20], torch.float32)
    q = queries(2, 4, 64, torch.float32)
    bad = tables.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(OpInputError, match="block_tables"):
        native.paged_attention.fn(q, kc, vc, bad, lens, 0.125)
    with pytest.raises(OpInputError, match="seq_lens"):
        native.paged_attention.fn(q, kc, vc, tables, torch.tensor([5, 10**6], dtype=torch.int32), 0.125)
    cu = torch.tensor([0, 2, 1], dtype=torch.int32)  # decreasing
    with pytest.raises(OpInputError, match="cu_seqlens_q"):
        native.prefill_attention.fn(q, kc, vc, tables, cu, lens, 2, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_sequences_filling_their_whole_block_table_row(dtype):
    kc, vc, tables, lens = paged_batch([64, 48, 64], dtype, spare=0)  # 4 columns of 16: the first and last full
    q = queries(3, 4, 64, dtype)
    assert paged_attention.check(native.paged_attention.fn, (q, kc, vc, tables, lens, 0.125), dtype) is None
    cu = torch.tensor([0, 40, 41, 105], dtype=torch.int32)
    q = queries(105, 4, 64, dtype)
    args = (q, kc, vc, tables, cu, lens, 64, 0.125)
    assert prefill_attention.check(native.prefill_attention.fn, args, dtype) is None


@needs_kernels
def test_padded_rows_read_nothing_of_their_stale_block_tables():
    kc, vc, tables, lens = paged_batch([6, 11, 9], torch.bfloat16)
    lens[1] = 0
    tables[1] = 10**6  # reading it would raise (or crash)
    q = queries(3, 4, 64, torch.bfloat16)
    assert paged_attention.check(native.paged_attention.fn, (q, kc, vc, tables, lens, 0.2), torch.bfloat16) is None


def _cache_write_args(tokens, dtype, *, heads=2, head_size=64, blocks=6, block_size=16, slots_dtype=torch.int64):
    """Keys and values as views of one [tokens, q + k + v] projection (a token stride past their rows, as a fused
    qkv linear leaves them), caches as the halves of one [blocks, 2, ...] buffer (strided), each token its own
    slot at random, every third a padded token (-1)."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 3 * heads * head_size, generator=gen).to(dtype)
    key = qkv[:, heads * head_size : 2 * heads * head_size].view(tokens, heads, head_size)
    value = qkv[:, 2 * heads * head_size :].view(tokens, heads, head_size)
    kv = torch.randn(blocks, 2, block_size, heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    return key, value, kv[:, 0], kv[:, 1], slots.to(slots_dtype)


@needs_kernels
@by_dtype
@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64], ids=["int32 slots", "int64 slots"])
@pytest.mark.parametrize("tokens", [0, 1, 7, 64], ids=lambda t: f"{t} tokens")
def test_the_cache_write_fills_each_slot_in_place_and_nothing_else(dtype, slots_dtype, tokens, monkeypatch):
    """Strided keys and caches, padded tokens: ``Op.check`` compares every byte of both caches with the reference's."""
    monkeypatch.setattr(native.attention, "reshape_and_cache", None)  # the kernel must answer
    args = _cache_write_args(tokens, dtype, slots_dtype=slots_dtype)
    assert reshape_and_cache.check(native.reshape_and_cache.fn, args, dtype) is None
    for sample in reshape_and_cache.samples(dtype, torch.device("cpu"), torch.Generator().manual_seed(0)):
        assert reshape_and_cache.check(native.reshape_and_cache.fn, sample.args, dtype) is None, sample.label


@needs_kernels
def test_a_prefill_sized_cache_write_shared_among_threads_is_the_references():
    """Past 256 KiB of rows the tokens are split among threads: the same bytes land in the same slots."""
    args = _cache_write_args(2000, torch.bfloat16, heads=4, head_size=128, blocks=200, block_size=16)
    assert reshape_and_cache.check(native.reshape_and_cache.fn, args, torch.bfloat16) is None


@needs_kernels
@pytest.mark.parametrize("slot", [-2, 96, 10**9])
def test_a_slot_outside_the_caches_raises_naming_it_before_anything_is_written(slot):
    key, value, kc, vc, slots = _cache_write_args(5, torch.float32)  # 6 blocks of 16: slots -1 .. 95
    slots[4] = slot
    before = kc.clone(), vc.clone()
    with pytest.raises(OpInputError, match=rf"slot_mapping\[4\] is {slot}, outside \[-1, 96\)"):
        native.reshape_and_cache.fn(key, value, kc, vc, slots)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def _registry() -> OpRegistry:
    registry = OpRegistry(ALL_OPS)
    for p in ops.PROVIDERS:
        registry.register(p, plugin="cpu", platform="cpu")
    return registry


def _bound(dtype: torch.dtype) -> dict[str, str]:
    chosen = _registry().bind(BindContext("cpu", "cpu", dtype)).providers
    return {op: chosen[op].name for op in ("paged_attention", "prefill_attention", "reshape_and_cache")}


@pytest.mark.slow
@needs_kernels
def test_builds_once_into_the_cache_directory_and_binds_above_the_torch_providers(fresh_state):
    private = fresh_state / native.PRIVATE_DIR
    assert native.check() == (True, f"not built yet (builds with {native._compiler()} into {private} at first use)")
    assert _bound(torch.bfloat16) == {
        "paged_attention": "cpu_native_paged_attention",
        "prefill_attention": "cpu_native_prefill_attention",
        "reshape_and_cache": "cpu_native_reshape_and_cache",
    }
    assert private.stat().st_mode & 0o777 == 0o700
    built = sorted(private.iterdir())
    assert [p.name.split(".", 1)[1] for p in built] == ["so", "so.sha256"]  # no temporary file left behind
    assert built[1].read_text().strip() == hashlib.sha256(built[0].read_bytes()).hexdigest()
    assert native.status == f"on ({built[0]})" and native.check() == (True, native.status)


def test_without_a_compiler_the_torch_providers_serve_and_the_probe_says_why(fresh_state, monkeypatch):
    monkeypatch.setattr(native, "_compiler", lambda: None)
    assert not native.available()
    assert "no C compiler" in native.status and native.check() == (False, native.status)
    assert _bound(torch.float32) == {
        "paged_attention": "cpu_paged_attention",
        "prefill_attention": "cpu_prefill_attention",
        "reshape_and_cache": "cpu_reshape_and_cache",
    }
    kc, vc, tables, lens = paged_batch([5, 20], torch.float32)
    args = (queries(2, 4, 64, torch.float32), kc, vc, tables, lens, 0.125)
    assert paged_attention.check(native.paged_attention.fn, args, torch.float32) is None  # the torch path


def test_a_failed_build_is_reported_and_declined(fresh_state, monkeypatch, tmp_path):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: no input files' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(native, "_compiler", lambda: str(broken))
    assert not native.available()
    assert "build or load failed" in native.status and "fatal error" in native.status
    monkeypatch.setattr(native, "_loaded", False)  # a later process: the probe reads the failure
    ok, why = native.check()
    assert not ok and "last build failed" in why and "fatal error" in why


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_switch_turns_the_kernels_off(fresh_state, monkeypatch, value):
    monkeypatch.setenv(native.ENV_SWITCH, value)
    assert not native.available()
    assert native.check() == (False, f"off ({native.ENV_SWITCH}={value})")
    assert _bound(torch.bfloat16) == {
        "paged_attention": "cpu_paged_attention",
        "prefill_attention": "cpu_prefill_attention",
        "reshape_and_cache": "cpu_reshape_and_cache",
    }


def test_a_missing_source_turns_the_kernels_off_without_failing_the_probe(fresh_state, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "SOURCES", (*native.SOURCES[:-1], tmp_path / "absent.c"))
    ok, why = native.check()
    assert not ok and "absent.c" in why
    assert not native.available() and "absent.c" in native.status
