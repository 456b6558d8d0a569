"""The Triton ``process_logits`` and ``top_logprobs`` kernels against their ops' contracts.

Without a GPU they run in Triton's CPU interpreter (the root conftest.py sets TRITON_INTERPRET=1):
every small sample of each op, every error input, and the value errors under validation; the real
vocabularies and row counts past 128 (``large`` samples) too, in bfloat16 (under 2 s each).
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton.logits import LogitsKernels  # noqa: E402
from vllm_port.ops import process_logits, top_logprobs  # noqa: E402
from vllm_port.ops.checks import validation  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
#: the CUDA target's blocks (interpreted: fewer steps of the same kernel)
KERNELS = LogitsKernels(CUDA)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("op", [process_logits, top_logprobs], ids=lambda op: op.name)
def test_kernel_honours_the_contract_on_every_small_sample(op, dtype):
    fn = getattr(KERNELS, op.name)
    samples = [s for s in op.samples(dtype, DEVICE, torch.Generator().manual_seed(0)) if not (INTERPRETED and s.large)]
    with validation():
        problems = [f"{s.label}: {p}" for s in samples if (p := op.check(fn, s.args, dtype))]
    assert not problems, problems


@pytest.mark.slow
@pytest.mark.parametrize("op", [process_logits, top_logprobs], ids=lambda op: op.name)
def test_kernel_honours_the_contract_at_real_vocabularies(op):
    fn = getattr(KERNELS, op.name)
    samples = [s for s in op.samples(torch.bfloat16, DEVICE, torch.Generator().manual_seed(0)) if s.large]
    assert any(s.args[0].shape[1] == 151936 for s in samples)
    with validation():
        problems = [f"{s.label}: {p}" for s in samples if (p := op.check(fn, s.args, torch.bfloat16))]
    assert not problems, problems


@pytest.mark.parametrize("op", [process_logits, top_logprobs], ids=lambda op: op.name)
def test_kernel_refuses_what_the_reference_refuses(op):
    fn = getattr(KERNELS, op.name)
    for case in op.errors(DEVICE):
        with pytest.raises(OpInputError, match=case.match.replace("[", r"\[")):
            fn(*case.args)
    for case in op.value_errors(DEVICE):
        with validation(), pytest.raises(OpInputError, match=case.match.replace("[", r"\[")):
            fn(*case.args)


def test_min_p_bans_exactly_below_the_ratio():
    """A row of known probabilities: min_p 0.3 keeps the tokens whose probability is >= 0.3 of the top one's."""
    probs = torch.tensor([[0.5, 0.2, 0.14, 0.1, 0.06]])
    logits = probs.log().to(DEVICE)
    zeros = torch.zeros(1, 5, device=DEVICE)
    args = (
        logits,
        zeros,
        zeros.int(),
        zeros.bool(),
        *(torch.tensor([v], device=DEVICE) for v in (1.0, 0.0, 0.0, 1.0, 0.3)),
    )
    got = KERNELS.process_logits(*args).cpu()
    assert torch.equal(got[0].isinf(), torch.tensor([False, False, True, True, True]))
