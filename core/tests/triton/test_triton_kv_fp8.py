"""The Triton FP8 KV-cache providers (the shared cache and attention kernels on e4m3 caches) against the ops' oracles.

Without a GPU they run in Triton's CPU interpreter with the interpreter target's small tiles; the ops' large
samples are left to GPU runs. The cache write must equal the reference's bytes (rounded in float32 to nearest
even: the interpreter's own conversion does not, so the kernel rounds on e4m3's grid first, as it does on GPUs
without FP8 hardware).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton import INTERPRETER  # noqa: E402
from vllm_port.kernels.triton.kv_fp8 import Fp8CacheKernels  # noqa: E402
from vllm_port.ops import paged_attention_fp8, prefill_attention_fp8, reshape_and_cache_fp8  # noqa: E402
from vllm_port.ops.checks import validation  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if torch.cuda.is_available() and not INTERPRETED:
    DEVICE, TARGET = torch.device("cuda"), CUDA
else:
    DEVICE, TARGET = torch.device("cpu"), INTERPRETER
OPS = [reshape_and_cache_fp8, paged_attention_fp8, prefill_attention_fp8]
#: under the interpreter, the first few hand samples of each op (each runs its programs in NumPy), then layout variants
_INTERPRETED_SAMPLES = 4


def _samples(op, dtype):
    found = op.samples(dtype, DEVICE, torch.Generator().manual_seed(0))
    if not INTERPRETED:
        return found
    small = [s for s in found if not s.large]
    views = [s for s in small if "index views of one buffer" in s.label or "last row" in s.label]
    return small[:_INTERPRETED_SAMPLES] + views  # a few hand samples; index dtypes, storage offsets, the last block


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_honour_the_contract(op, dtype):
    fn = getattr(Fp8CacheKernels(TARGET), op.name)
    for sample in _samples(op, dtype):
        with validation():
            problem = op.check(fn, sample.args, dtype)
        assert problem is None, f"{sample.label}: {problem}"


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_signatures_and_refusals(op):
    fn = getattr(Fp8CacheKernels(TARGET), op.name)
    assert inspect.signature(fn, eval_str=True) == op.signature
    for case in op.errors(DEVICE):
        with pytest.raises(OpInputError, match=re.escape(case.match)):
            fn(*case.args)
