"""The Triton paged-attention kernels (decode, prefill) against the op contract.

Without a GPU they run in Triton's CPU interpreter (see conftest.py), which executes programs one
by one: the 4096-token decode sample is left to GPU runs, and the Llama-sized samples run with the
CUDA target's larger tiles (fewer interpreted steps). Every target's launch configuration is
exercised on small shapes, and the code paths the op's samples do not reach (split-K decode,
cache blocks larger or smaller than a key tile, head sizes that are not powers of two, windows
spanning many tiles) get their own cases. Cache slots no sequence owns hold NaN throughout.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton.attention import AttentionKernels, _decode_splits  # noqa: E402
from vllm_port.kernels.triton_target import INTERPRETER  # noqa: E402
from vllm_port.ops import OpRegistry, Provider, paged_attention, prefill_attention  # noqa: E402
from vllm_port.ops.attention import _paged_batch  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402
from vllm_port_rocm.triton_targets import ROCM  # noqa: E402
from vllm_port_xpu.triton_targets import XPU  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if torch.cuda.is_available() and not INTERPRETED:
    DEVICE = torch.device("cuda")
    NATIVE = ROCM if torch.version.hip else CUDA
else:
    DEVICE, NATIVE = torch.device("cpu"), INTERPRETER

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = (paged_attention, prefill_attention)


def kernels(target=NATIVE) -> AttentionKernels:
    return AttentionKernels(target)


#: what marks a sample Llama-sized (head 128, or blocks of 128 tokens and more) or long-context in its label
_LARGE_SAMPLE = ("llama", "sharp", "head 128", "block size 128", "block size 256")


def target_for(label: str):
    """The interpreter runs Llama-sized and long-context samples with the CUDA target's tiles: 4-15x fewer steps.

    The interpreter's cost is Python per tile, so the small native tiles (which the small samples
    push across their block boundaries) make a head-128 prefill of 390 tokens take 30 s against 2 s.
    """
    return CUDA if DEVICE.type == "cpu" and any(mark in label for mark in _LARGE_SAMPLE) else NATIVE


def interpreted_samples(op, dtype, gen):
    """The op's samples the interpreter runs in seconds: not the ``large`` ones (GPU runs cover them).

    bfloat16 runs every other sample; float32 and float16 (whose code paths differ only in the
    rounding) run the first five (block boundaries, GQA, window, soft cap), as they did before the
    op grew its shape and padding samples, and the unbent soft cap of 1e6, whose error (tanh's
    cancellation, 1e-2) only their tolerances see.
    """
    found = op.samples(dtype, DEVICE, gen)
    if DEVICE.type != "cpu":
        return found
    if dtype == torch.bfloat16:
        return [s for s in found if not s.large]
    return found[:5] + [s for s in found[5:] if s.label.startswith("soft cap 1e6")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_samples_are_within_tolerance(op, dtype):
    for sample in interpreted_samples(op, dtype, torch.Generator().manual_seed(0)):
        fn = getattr(kernels(target_for(sample.label)), op.name)
        assert op.check(fn, sample.args, dtype) is None, sample.label


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_error_inputs_raise(op):
    fn = getattr(kernels(), op.name)
    for case in op.errors(DEVICE):
        with pytest.raises(OpInputError, match=case.match):
            fn(*case.args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "dtype"),
    [(CUDA, torch.bfloat16), (ROCM, torch.float16), (XPU, torch.float32)],
    ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_target_configuration_on_small_shapes(op, target, dtype):
    gen = torch.Generator().manual_seed(1)
    fn = getattr(kernels(target), op.name)
    for sample in op.samples(dtype, DEVICE, gen)[:4]:  # block boundaries, prefix or gqa, window
        assert op.check(fn, sample.args, dtype) is None, f"{target.name} {sample.label}"


def test_providers_have_the_reference_signatures():
    registry = OpRegistry(OPS)
    k = kernels()
    for name in AttentionKernels.OPS:
        registry.register(Provider(name, f"triton_{name}", getattr(k, name)), plugin="test", platform="test")
        assert inspect.signature(getattr(k, name), eval_str=True) == registry.ops[name].signature


# ------------------------------------------------------------------------------------------------
# Decode: split-K
# ------------------------------------------------------------------------------------------------


def _decode_case(dtype, seq_lens, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc, tables, lens = _paged_batch(gen, DEVICE, dtype, seq_lens, kv_heads, head_size, block_size)
    q = torch.randn(len(seq_lens), heads, head_size, generator=gen).to(DEVICE, dtype)
    return (q, kc, vc, tables, lens, head_size**-0.5, window, cap)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [2, 5])
def test_split_k_decode_merges_partials_exactly(dtype, splits):
    k = kernels()
    # lengths from one tile to many, one shorter than the number of splits (empty splits)
    for window, cap in ((0, 0.0), (23, 0.0), (0, 20.0)):
        args = _decode_case(dtype, [1, 3, 70, 129], 8, 2, window=window, cap=cap, seed=splits)
        split_fn = lambda *a: k._decode(*a, num_splits=splits)  # noqa: E731
        assert paged_attention.check(split_fn, args, dtype) is None, (window, cap)


@pytest.mark.slow
def test_merge_of_many_splits_in_one_chunk():
    """33-128 splits: one step of the merge over 8 warps (fewer splits than a sequence's tiles, and more)."""
    args = _decode_case(torch.float32, [5, 300, 1500], 4, 2, block_size=16, seed=5)
    fn = lambda *a: kernels()._decode(*a, num_splits=100)  # noqa: E731
    assert paged_attention.check(fn, args, torch.float32) is None


@pytest.mark.slow
def test_merge_of_more_splits_than_one_chunk():
    """Past ``_MERGE_CHUNK`` splits the merge sums partials chunk by chunk (a ragged last chunk, empty splits)."""
    from vllm_port.kernels.triton.attention import _MERGE_CHUNK

    args = _decode_case(torch.float32, [5, 300, 700], 4, 2, block_size=16, seed=3)
    fn = lambda *a: kernels()._decode(*a, num_splits=_MERGE_CHUNK + 9)  # noqa: E731
    assert paged_attention.check(fn, args, torch.float32) is None


def test_a_sliding_window_caps_the_splits(monkeypatch):
    """Splits share the keys a query can see: with a window, the window's tiles, not the whole table's."""
    import vllm_port.kernels.triton.attention as attention

    seen = []
    real = attention._decode_splits
    monkeypatch.setattr(attention, "_decode_splits", lambda n, tiles, *a: seen.append(tiles) or real(n, tiles, *a))
    args = _decode_case(torch.float32, [400], 4, 2, window=40, seed=4)
    k = kernels()
    assert paged_attention.check(k.paged_attention, args, torch.float32) is None
    assert seen == [triton.cdiv(40, k.target.decode_block_n or k.target.attn_block_n) + 1]


def test_empty_sequence_gives_zeros_like_the_reference():
    k = kernels()
    args = _decode_case(torch.float32, [0, 17], 4, 2)
    for splits in (1, 3):
        assert paged_attention.check(lambda *a, s=splits: k._decode(*a, num_splits=s), args, torch.float32) is None


def test_padded_sequences_read_nothing_of_their_block_tables():
    """seq_lens 0 (graph-capture padding): zero rows, whatever the padded rows of the block table hold."""
    k = kernels()
    decode = list(_decode_case(torch.bfloat16, [9, 0, 20, 0], 4, 2))
    decode[3][decode[4] == 0] = 1 << 30  # a stale entry no cache has: reading it would fault
    for splits in (1, 3):
        got = k._decode(*decode, num_splits=splits)
        assert paged_attention.check(lambda *a, g=got: g, tuple(decode), torch.bfloat16) is None
        assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[3], torch.zeros_like(got[3]))
    prefill = list(_prefill_case(torch.bfloat16, [4, 3, 2], [5, 0, 0], 4, 2))
    prefill[5][1:] = 0  # the last two sequences are padding that owns query rows
    prefill[3][1:] = 1 << 30
    got = k.prefill_attention(*prefill)
    assert torch.equal(got[4:], torch.zeros_like(got[4:]))
    assert prefill_attention.check(lambda *a: got, tuple(prefill), torch.bfloat16) is None


def test_split_rule_uses_host_shapes_only():
    # the H200 benchmark: 64 x 8 programs for 132 SMs already fill the GPU
    assert _decode_splits(64 * 8, 4096 // 64, 132) == 1
    # one long sequence: split its keys, but keep >= 4 tiles per split
    assert _decode_splits(8, 4096 // 64, 132) == 16
    assert _decode_splits(8, 8, 132) == 2
    assert _decode_splits(32, 2, 132) == 1
    # the split count never exceeds its cap
    assert _decode_splits(1, 1 << 20, 132) == 256
    # the target's knobs: programs per SM to aim at, the fewest tiles a split keeps
    assert _decode_splits(8, 1 << 20, 132, per_sm=8) == 132
    assert _decode_splits(8, 4096 // 64, 132, per_sm=8, min_tiles=2) == 32
    assert _decode_splits(200, 1 << 20, 132, per_sm=4) == 3  # 200 programs: under half of 4 per SM
    assert _decode_splits(300, 1 << 20, 132, per_sm=4) == 1  # 300: over half


def test_decode_chooses_a_split_for_few_long_sequences():
    # the interpreter pretends 4 SMs: 1 sequence x 1 KV head of 300 tokens splits
    args = _decode_case(torch.float32, [300], 4, 1)
    assert _decode_splits(1, triton.cdiv(args[3].shape[1] * 16, INTERPRETER.attn_block_n), 4) > 1
    assert paged_attention.check(kernels(INTERPRETER).paged_attention, args, torch.float32) is None


# ------------------------------------------------------------------------------------------------
# Cache block sizes against tile sizes, odd head sizes, long windows
# ------------------------------------------------------------------------------------------------

#: block 64 holds several 16-key tiles (one block-table load per tile); block 8 splits each tile
#: across two blocks (a load per key); head 80 pads to 128; head 32 is the smallest dot.
GEOMETRIES = [(64, 64), (8, 64), (16, 80), (32, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_size", "head_size"), GEOMETRIES)
def test_decode_block_and_head_sizes(dtype, block_size, head_size):
    args = _decode_case(dtype, [1, 16, 65, 100], 4, 2, head_size=head_size, block_size=block_size, window=40)
    assert paged_attention.check(kernels().paged_attention, args, dtype) is None


def _prefill_case(
    dtype, q_lens, prefixes, heads, kv_heads, head_size=64, block_size=16, window=0, cap=0.0, extra_len=0
):
    gen = torch.Generator().manual_seed(7)
    seq_lens = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
    kc, vc, tables, lens = _paged_batch(gen, DEVICE, dtype, seq_lens, kv_heads, head_size, block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(DEVICE, dtype)
    return (q, kc, vc, tables, cu, lens, max(q_lens) + extra_len, head_size**-0.5, window, cap)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("block_size", "head_size"), GEOMETRIES)
def test_prefill_block_and_head_sizes(dtype, block_size, head_size):
    args = _prefill_case(dtype, [37, 5], [11, 40], 4, 2, head_size=head_size, block_size=block_size)
    assert prefill_attention.check(kernels().prefill_attention, args, dtype) is None


@pytest.mark.parametrize("window", [1, 7, 20, 33])
def test_prefill_window_spanning_many_tiles(window):
    # 50 queries after a 45-token prefix: tiles before the window edge, whole tiles, diagonal tiles
    args = _prefill_case(torch.float32, [50, 3], [45, 0], 2, 1, window=window, cap=15.0)
    assert prefill_attention.check(kernels().prefill_attention, args, torch.float32) is None


def test_prefill_grid_larger_than_the_longest_query_and_strided_query():
    args = list(_prefill_case(torch.bfloat16, [20, 1], [3, 30], 4, 2, extra_len=40))
    qkv = torch.cat([args[0], torch.zeros_like(args[0])], dim=1)  # query as a slice of a fused QKV tensor
    args[0] = qkv[:, :4]
    assert not args[0].is_contiguous()
    assert prefill_attention.check(kernels().prefill_attention, tuple(args), torch.bfloat16) is None


@pytest.mark.slow
@pytest.mark.parametrize("order", ["head", "all_heads"])
def test_prefill_launch_orders_agree(order):
    """However the heads interleave, every (head, sequence, query block) runs once: the same answer."""
    k = kernels(dataclasses.replace(NATIVE, prefill_order=order))
    args = _prefill_case(torch.float32, [50, 3, 17], [45, 0, 9], 4, 2, window=30)
    assert prefill_attention.check(k.prefill_attention, args, torch.float32) is None


def test_an_unknown_launch_order_is_named():
    with pytest.raises(ValueError, match="prefill_order must be one of head, all_heads, got 'fastest'"):
        dataclasses.replace(NATIVE, prefill_order="fastest")


@pytest.mark.slow
def test_wide_tiles_on_the_interpreter():
    # block_m 32 / block_n 32 against 16-token cache blocks: the vector block-table path in prefill
    k = kernels(dataclasses.replace(INTERPRETER, attn_block_m=32, attn_block_n=32))
    args = _prefill_case(torch.float16, [33, 64], [0, 17], 4, 4)
    assert prefill_attention.check(k.prefill_attention, args, torch.float16) is None
    dargs = _decode_case(torch.float16, [31, 64, 90], 4, 4)
    assert paged_attention.check(k.paged_attention, dargs, torch.float16) is None


# ------------------------------------------------------------------------------------------------
# TMA: key tiles inside one cache block, loaded through tensor descriptors (the Hopper path)
# ------------------------------------------------------------------------------------------------

TMA = dataclasses.replace(INTERPRETER if DEVICE.type == "cpu" else NATIVE, prefill_tma=True, decode_tma=True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tma_tiles_match_the_reference(dtype):
    """Blocks of two key tiles each; slots past a sequence hold NaN (the TMA box reads them)."""
    from vllm_port.kernels.triton.attention import _kv_descriptors

    block = 2 * max(TMA.attn_block_n, TMA.decode_block_n)  # two key tiles per block, on every target
    args = _prefill_case(dtype, [37, 5, 64], [11, 40, 0], 4, 2, head_size=64, block_size=block)
    assert _kv_descriptors(args[1], args[2], TMA.attn_block_n) is not None  # the TMA path runs
    for window, cap in ((0, 0.0), (20, 0.0), (0, 15.0)):
        case = (*args[:8], window, cap)
        assert prefill_attention.check(kernels(TMA).prefill_attention, case, dtype) is None, (window, cap)
    dargs = _decode_case(dtype, [1, 31, 64, 300], 8, 2, head_size=64, block_size=block)
    for splits in (1, 3):
        fn = lambda *a, s=splits: kernels(TMA)._decode(*a, num_splits=s)  # noqa: E731
        assert paged_attention.check(fn, dargs, dtype) is None, splits


def test_tma_falls_back_to_gathers_where_the_layout_forbids_it():
    """16-token blocks under 32-key tiles, or heads not contiguous in a row: no descriptor, the same answer."""
    from vllm_port.kernels.triton.attention import _kv_descriptors

    wide = dataclasses.replace(TMA, attn_block_m=32, attn_block_n=32, decode_block_n=32)
    args = _prefill_case(torch.float32, [33, 20], [0, 17], 4, 2, head_size=64, block_size=16)
    assert _kv_descriptors(args[1], args[2], 32) is None
    assert prefill_attention.check(kernels(wide).prefill_attention, args, torch.float32) is None
    kc = torch.full((8, 32, 2, 2, 64), float("nan"), device=DEVICE)[:, :, :, 0]  # heads 128 apart in a row
    assert _kv_descriptors(kc, kc, 16) is None


@pytest.mark.slow
def test_launchers_read_no_tensor_values_on_the_host(monkeypatch):
    decode = _decode_case(torch.bfloat16, [5, 300], 4, 1, window=100)  # few programs: the split path
    prefill = _prefill_case(torch.bfloat16, [20, 3], [0, 30], 4, 2)

    def refuse(self, *args):
        raise AssertionError("the launcher synchronised with the device")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    k = kernels()
    got_decode, got_prefill = k.paged_attention(*decode), k.prefill_attention(*prefill)
    monkeypatch.undo()
    assert paged_attention.check(lambda *a: got_decode, decode, torch.bfloat16) is None
    assert prefill_attention.check(lambda *a: got_prefill, prefill, torch.bfloat16) is None


def test_int64_block_tables_and_lengths():
    decode = list(_decode_case(torch.float16, [9, 40], 4, 2, window=20))
    decode[3], decode[4] = decode[3].long(), decode[4].long()
    assert paged_attention.check(kernels().paged_attention, tuple(decode), torch.float16) is None
    prefill = list(_prefill_case(torch.float16, [17, 4], [3, 20], 4, 2, window=9))
    prefill[3], prefill[4], prefill[5] = prefill[3].long(), prefill[4].long(), prefill[5].long()
    assert prefill_attention.check(kernels().prefill_attention, tuple(prefill), torch.float16) is None
