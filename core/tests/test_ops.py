"""The op references against formulas written out in float64, their error inputs, ``Op.check`` and the input checks."""

import inspect
import re

import pytest
import torch

import vllm_port.ops
from vllm_port.errors import OpInputError
from vllm_port.ops import (
    ALL_OPS,
    INPUT_CHECKS,
    checks,
    fused_add_rms_norm,
    paged_attention,
    prefill_attention,
    rms_norm,
    silu_and_mul,
)
from vllm_port.ops._op import precision_loss


def test_rms_norm_reference_matches_the_formula():
    x, w = torch.randn(5, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 32 + 1e-5) * w
    torch.testing.assert_close(rms_norm.reference(x, w, 1e-5), expected)


def test_silu_and_mul_reference_matches_the_formula():
    x = torch.randn(3, 2, 32, dtype=torch.float64)
    gate, up = x[..., :16], x[..., 16:]
    torch.testing.assert_close(silu_and_mul.reference(x), gate / (1 + torch.exp(-gate)) * up)


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda op: op.name)
def test_error_inputs_raise_naming_the_op_and_argument(op):
    for case in op.errors(torch.device("cpu")):
        with pytest.raises(OpInputError, match=re.escape(case.match)) as info:
            op.reference(*case.args)
        assert str(info.value).startswith(f"{op.name}:"), case.label


@pytest.mark.slow
@pytest.mark.parametrize("op", ALL_OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_within_its_own_tolerance_and_samples_are_random(op, dtype):
    gen = torch.Generator().manual_seed(1)
    for sample in op.samples(dtype, torch.device("cpu"), gen):
        assert op.check(op.reference, sample.args, dtype) is None, sample.label
        assert bool(sample.args[0].ne(0).any()), f"{sample.label}: main input is all zeros"
    assert all(t.reason for t in op.tolerances.values())


def test_check_catches_wrong_values_shapes_and_dtypes():
    x, w = torch.randn(4, 8), torch.randn(8)
    good = rms_norm.reference(x, w, 1e-6)
    assert rms_norm.check(lambda *_: good, (x, w, 1e-6), torch.float32) is None
    ignored_epsilon = rms_norm.reference(x, w, 1.0)
    assert "elements off" in rms_norm.check(lambda *_: ignored_epsilon, (x, w, 1e-6), torch.float32)
    assert "shape" in rms_norm.check(lambda *_: good[:3], (x, w, 1e-6), torch.float32)
    assert "dtype" in rms_norm.check(lambda *_: good.half(), (x, w, 1e-6), torch.float32)
    poisoned = good.clone()
    poisoned[2, 3] = float("nan")
    assert "first at (2, 3)" in rms_norm.check(lambda *_: poisoned, (x, w, 1e-6), torch.float32)


# ------------------------------------------------------------------------------------------------
# Layout: fakes, contiguous outputs, views
# ------------------------------------------------------------------------------------------------


def _meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


@pytest.mark.slow
@pytest.mark.parametrize("op", [op for op in ALL_OPS if op.fake is not None], ids=lambda op: op.name)
def test_fakes_describe_the_output_of_every_sample(op):
    """What torch.compile assumes (shape, dtype, contiguous strides) is what the reference returns, sample by sample."""
    for sample in op.samples(torch.bfloat16, torch.device("cpu"), torch.Generator().manual_seed(2)):
        args = tuple(
            a.clone() if n in op.mutates else a for a, n in zip(sample.args, op.signature.parameters, strict=False)
        )
        real, fake = op.reference(*args), op.fake(*map(_meta, sample.args))
        if real is None:
            assert fake is None, sample.label
            continue
        pairs = zip(fake, real, strict=True) if isinstance(real, tuple) else [(fake, real)]  # top_logprobs: two
        for f, r in pairs:
            assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride()), sample.label
            assert r.is_contiguous(), sample.label


@pytest.mark.slow
def test_every_op_has_samples_with_views():
    """Each op with tensor inputs is sampled with a strided view among them (a slice, a transpose)."""
    for op in ALL_OPS:
        if op.name == "sample":
            continue
        samples = op.samples(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
        views = [s.label for s in samples if any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in s.args)]
        assert views, f"{op.name}: no sample passes a non-contiguous view"


def test_check_refuses_a_strided_output():
    x, w = torch.randn(6, 8), torch.randn(8)
    good = rms_norm.reference(x, w, 1e-6)
    transposed = good.t().contiguous().t()
    assert "the contract returns contiguous tensors" in rms_norm.check(
        lambda *_: transposed, (x, w, 1e-6), torch.float32
    )


def test_check_keeps_views_of_in_place_arguments_and_sees_writes_around_them():
    x = torch.randn(3, 8)
    buf = torch.randn(3, 24)
    residual = buf[:, 8:16]  # rows 24 apart, with neighbours on both sides
    w = torch.ones(8)

    def through_the_view(x, residual, weight, epsilon):
        assert residual.stride() == (24, 1) and residual.storage_offset() == 8  # the provider sees the view
        return fused_add_rms_norm.reference(x, residual, weight, epsilon)

    def packed(x, residual, weight, epsilon):
        total = x + residual
        residual.as_strided((24,), (1,), residual.storage_offset()).copy_(total.flatten())
        return rms_norm.reference(total, weight, epsilon)

    assert fused_add_rms_norm.check(through_the_view, (x, residual, w, 1e-6), torch.float32) is None
    problem = fused_add_rms_norm.check(packed, (x, residual, w, 1e-6), torch.float32)
    assert "elements of its storage outside the view (3, 8)" in problem and "write only through the view" in problem
    assert torch.equal(buf[:, 8:16], residual)  # the sample itself is untouched: the check works on copies


def test_check_sees_writes_beside_a_read_only_view():
    buf = torch.randn(4, 32)
    x = buf[:, :16]

    def scribbles(x):
        x.as_strided((4,), (32,), 16).fill_(0.0)  # the column just right of the view: outside, in its storage
        return silu_and_mul.reference(x)

    problem = silu_and_mul.check(scribbles, (x,), torch.float32)
    assert "outside the view" in problem


# ------------------------------------------------------------------------------------------------
# Error statistics: precision lost inside the tolerance
# ------------------------------------------------------------------------------------------------


def _bf16_accumulating_rms_norm(x, weight, epsilon):
    squares = (x.float() ** 2).to(x.dtype)
    total = torch.zeros(x.shape[0], 1, dtype=x.dtype)
    for start in range(0, x.shape[-1], 256):
        total = total + squares[:, start : start + 256].sum(-1, keepdim=True)
    return (x.float() * torch.rsqrt(total.float() / x.shape[-1] + epsilon)).to(x.dtype) * weight


def test_statistics_catch_a_norm_that_accumulates_in_bfloat16():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16384, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(16384, generator=gen)).bfloat16()
    problem = rms_norm.check(_bf16_accumulating_rms_norm, (x, w, 1e-6), torch.bfloat16)
    assert problem is not None and "precision lost inside the tolerance" in problem
    assert "elements off" not in problem  # every element is within the tolerance: only the statistics see it


def test_statistics_pass_a_provider_more_precise_than_the_reference():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 8192, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(8192, generator=gen)).bfloat16()

    def one_rounding(x, weight, epsilon):  # scales in float32 and rounds once: better than the reference
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float()).to(x.dtype)

    assert rms_norm.check(one_rounding, (x, w, 1e-6), torch.bfloat16) is None


def test_precision_loss_against_an_exact_baseline_admits_one_correct_rounding():
    want = torch.linspace(1.0, 2.0, 8192, dtype=torch.float64) + 1e-9  # not representable in bfloat16
    rounded = want.to(torch.bfloat16)  # to nearest: what any correct kernel returns at best
    truncated = (want.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)  # toward zero
    # a baseline that happens to be exact (error 0) still counts as one rounding, so rounding is no loss
    assert precision_loss(rounded, want, want, torch.bfloat16) is None
    assert "precision lost" in precision_loss(truncated, want, want, torch.bfloat16)  # twice the mean error
    assert precision_loss(truncated[:100], want[:100], want[:100], torch.bfloat16) is None  # too few elements


# ------------------------------------------------------------------------------------------------
# Attention: the vectorised references state the per-sequence formula; padded sequences
# ------------------------------------------------------------------------------------------------


def _per_sequence(query, key_cache, value_cache, block_tables, seq_lens, q_starts, scale, window, cap):
    """Attention written per sequence in float64 from the definition: for checking the batched references."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size = key_cache.shape[1]
    for i, length in enumerate(seq_lens.tolist()):
        start, end = q_starts[i], q_starts[i + 1]
        if length == 0:
            continue
        slots = [int(block_tables[i, t // block_size]) * block_size + t % block_size for t in range(length)]
        k = key_cache.flatten(0, 1)[slots].double()
        v = value_cache.flatten(0, 1)[slots].double()
        group = query.shape[1] // k.shape[1]
        for j in range(end - start):
            pos = length - (end - start) + j
            for h in range(query.shape[1]):
                s = k[: pos + 1, h // group] @ query[start + j, h].double() * scale
                if cap > 0:
                    s = cap * torch.tanh(s / cap)
                if window > 0:
                    s[: max(0, pos + 1 - window)] = float("-inf")
                out[start + j, h] = torch.softmax(s, 0) @ v[: pos + 1, h // group]
    return out


@pytest.mark.parametrize("op", [paged_attention, prefill_attention], ids=lambda op: op.name)
def test_attention_references_equal_the_per_sequence_formula(op):
    for sample in op.samples(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(5))[:5]:
        args = tuple(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in sample.args)
        if op is paged_attention:
            q, kc, vc, tables, lens, scale, window, cap = args
            starts = list(range(q.shape[0] + 1))
        else:
            q, kc, vc, tables, cu, lens, _, scale, window, cap = args
            starts = cu.tolist()
        want = _per_sequence(q, kc, vc, tables, lens, starts, scale, window, cap)
        torch.testing.assert_close(op.reference(*args), want, rtol=1e-9, atol=1e-9, msg=sample.label)


def test_padded_sequences_get_zero_rows_and_their_block_tables_are_not_read():
    sample = next(
        s
        for s in paged_attention.samples(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
        if "padded" in s.label
    )
    q, kc, vc, tables, lens, *rest = sample.args
    tables = tables.clone()
    tables[lens == 0] = 10**6  # stale entries far outside the cache
    out = paged_attention.reference(q, kc, vc, tables, lens, *rest)
    assert torch.equal(out[lens == 0], torch.zeros_like(out[lens == 0])) and bool(out[lens > 0].isfinite().all())
    garbage = out.clone()
    garbage[lens == 0] = 1e-6
    problem = paged_attention.check(lambda *a: garbage, sample.args, torch.float32)
    assert "rows of padded sequences (seq_lens 0) are not exactly 0" in problem


# ------------------------------------------------------------------------------------------------
# Input checks, exported for hand-written providers
# ------------------------------------------------------------------------------------------------


def test_every_op_exports_an_input_check_with_its_signature():
    assert set(INPUT_CHECKS) == {op.name for op in ALL_OPS}
    for op in ALL_OPS:
        check = INPUT_CHECKS[op.name]
        assert getattr(checks, f"check_{op.name}") is check is getattr(vllm_port.ops, f"check_{op.name}")
        params = [(p.name, p.default) for p in inspect.signature(check).parameters.values()]
        assert params == [(p.name, p.default) for p in op.signature.parameters.values()], op.name


@pytest.mark.parametrize("op", ALL_OPS, ids=lambda op: op.name)
def test_a_hand_written_provider_that_calls_the_check_refuses_every_error_input(op):
    def provider(*args, **kwargs):
        INPUT_CHECKS[op.name](*args, **kwargs)
        return None  # a kernel would run here

    for case in op.errors(torch.device("cpu")):
        with pytest.raises(OpInputError, match=re.escape(case.match)):
            provider(*case.args)
    for sample in op.samples(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))[:2]:
        provider(*sample.args)  # and accepts the valid ones
