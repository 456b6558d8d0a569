"""The Triton ``fp8_linear`` (per-token e4m3 activations, e4m3 weights) against the op's float64 oracle.

Without a GPU the kernel runs in Triton's CPU interpreter (see conftest.py) with the interpreter target's
small tiles: the op's small samples cross tile edges, pad rows to 16, split the reduction (the interpreter
pretends to have 4 multiprocessors) and take the wide path past 16 rows; the Llama-sized samples are left
to GPU runs. The interpreter's dot takes the e4m3 operands widened to float32 (exact), so it checks the
quantisation, the scales and the tiling, not the FP8 tensor cores.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton import INTERPRETER, providers  # noqa: E402
from vllm_port.kernels.triton.fp8_linear import Fp8LinearKernels  # noqa: E402
from vllm_port.ops import fp8_linear  # noqa: E402
from vllm_port.ops.checks import validation  # noqa: E402
from vllm_port.ops.fp8 import quantize_fp8_weight  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if torch.cuda.is_available() and not INTERPRETED:
    DEVICE, TARGET = torch.device("cuda"), CUDA
else:
    DEVICE, TARGET = torch.device("cpu"), INTERPRETER


def _check(fn, args, dtype):
    with validation():
        problem = fp8_linear.check(fn, args, dtype)
    assert problem is None, problem


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_kernel_honours_the_contract_on_the_op_samples(dtype):
    kernels = Fp8LinearKernels(TARGET)
    for sample in fp8_linear.samples(dtype, DEVICE, torch.Generator().manual_seed(0)):
        if sample.large and INTERPRETED:
            continue
        _check(kernels.fp8_linear, sample.args, dtype)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
@pytest.mark.parametrize("rows", [1, 5, 24], ids=lambda m: f"{m} rows")
def test_each_scale_and_path_small(granularity, rows):
    """One row and 5 (skinny, split-K), 24 (wide tiles): each scale layout, in_features past a group edge."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 200, generator=gen).to(DEVICE, torch.bfloat16)
    q, s = quantize_fp8_weight(torch.randn(40, 200, generator=gen) / 200**0.5, granularity)
    bias = torch.randn(40, generator=gen).to(DEVICE, torch.bfloat16)
    _check(Fp8LinearKernels(TARGET).fp8_linear, (x, q.to(DEVICE), s.to(DEVICE), bias), torch.bfloat16)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_forced_splits_agree(split_k):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen).to(DEVICE, torch.float32)
    q, s = quantize_fp8_weight(torch.randn(48, 256, generator=gen) / 16, "group")
    kernels = Fp8LinearKernels(TARGET)
    args = (x, q.to(DEVICE), s.to(DEVICE))
    _check(lambda *a: kernels._launch(*a, None, split_k=split_k), args, torch.float32)


def test_every_gpu_target_binds_it_and_the_cuda_target_uses_fp8_dots():
    from vllm_port_rocm.triton_targets import ROCM
    from vllm_port_xpu.triton_targets import XPU

    for target in (CUDA, ROCM, XPU):
        assert "triton_fp8_linear" in {p.name for p in providers(target)}
        assert target.fp8_skinny_rows > 0
    assert CUDA.fp8_dot and not ROCM.fp8_dot and not dataclasses.replace(INTERPRETER).fp8_dot


def test_signature_equals_the_reference_and_errors_are_refused():
    fn = Fp8LinearKernels(TARGET).fp8_linear
    assert inspect.signature(fn, eval_str=True) == fp8_linear.signature
    for case in fp8_linear.errors(DEVICE):
        with pytest.raises(OpInputError, match=re.escape(case.match)):
            fn(*case.args)
    for case in fp8_linear.value_errors(DEVICE):
        with validation(), pytest.raises(OpInputError, match=re.escape(case.match)):
            fn(*case.args)
