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


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
def test_one_row_takes_the_one_launch_path_with_the_weight_widened_in_registers(granularity, dtype, monkeypatch):
    """``fp8_one_row``: no quantising launch; the exact product, split or not, a bias or none, any leading dims."""
    import vllm_port.kernels.triton.fp8_linear as module
    from vllm_port.kernels.triton.linear import LinearKernels

    def quantising(*args, **kwargs):
        raise AssertionError("one row was quantised: the one-row path was not taken")

    monkeypatch.setattr(module, "_quantize_rows_kernel", quantising)
    gen = torch.Generator().manual_seed(7)
    q, s = quantize_fp8_weight(torch.randn(70, 300, generator=gen) / 300**0.5, granularity)
    q, s = q.to(DEVICE), s.to(DEVICE)
    bias = torch.randn(70, generator=gen).to(DEVICE, dtype)
    kernels = Fp8LinearKernels(TARGET)
    for shape in ((1, 300), (1, 1, 300), (300,)):
        x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        for b in (bias, None):
            _check(kernels.fp8_linear, (x, q, s, b), dtype)
    one_row = LinearKernels(TARGET)
    x = torch.randn(1, 300, generator=gen).to(DEVICE, dtype)
    for split_k in (1, 2, 5):
        fn = lambda *a, k=split_k: one_row._launch(a[0], a[1], a[3], k, weight_scale=a[2], one_row=TARGET.fp8_one_row)  # noqa: E731
        _check(fn, (x, q, s, bias), dtype)


def test_one_row_with_group_scales_or_without_one_row_tiles_is_quantised(monkeypatch):
    import vllm_port.kernels.triton.fp8_linear as module

    quantised = []
    real = module._quantize_rows_kernel
    monkeypatch.setattr(module, "_quantize_rows_kernel", _Recording(real, quantised))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 256, generator=gen).to(DEVICE, torch.bfloat16)
    for granularity, target in (("group", TARGET), ("channel", dataclasses.replace(TARGET, fp8_one_row=None))):
        q, s = quantize_fp8_weight(torch.randn(32, 256, generator=gen) / 16, granularity)
        _check(Fp8LinearKernels(target).fp8_linear, (x, q.to(DEVICE), s.to(DEVICE)), torch.bfloat16)
    assert len(quantised) == 2


class _Recording:
    """A Triton kernel that records each launch (``kernel[grid](...)``) and launches it."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


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
