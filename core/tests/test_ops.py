"""The op references against formulas written out in float64, their error inputs, and ``Op.check``."""

import re

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import ALL_OPS, rms_norm, silu_and_mul


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
