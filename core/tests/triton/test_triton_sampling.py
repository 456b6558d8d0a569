"""The Triton sampler against the op contract, the reference's draws and the distribution it must follow.

Without a GPU the kernel runs in Triton's CPU interpreter (see conftest.py). The kernel is a
bitwise sampler: on every sample of the op it must draw the reference's tokens from the same seeds,
up to the roundings the contract allows (``check_reference_draws``). Interpreted, most samples run
with the CUDA target's wider blocks (fewer interpreted steps); the real vocabularies also take the
split-vocabulary path there, since the interpreter pretends to have only a few SMs.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton.sampling import SamplingKernels, _vocab_splits  # noqa: E402
from vllm_port.kernels.triton_target import INTERPRETER  # noqa: E402
from vllm_port.ops import OpRegistry, Provider, sample  # noqa: E402
from vllm_port.ops.sampling import check_reference_draws, gumbel_noise, sample_reference  # noqa: E402
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


def sampler(target=NATIVE):
    return SamplingKernels(target).sample


def batch(rows, vocab, temperature, top_k, top_p, seed=0, scale=3.0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(rows, vocab, generator=gen)).to(DEVICE, dtype)
    return (
        logits,
        torch.as_tensor(temperature, dtype=torch.float32).expand(rows).contiguous().to(DEVICE),
        torch.as_tensor(top_k, dtype=torch.int32).expand(rows).contiguous().to(DEVICE),
        torch.as_tensor(top_p, dtype=torch.float32).expand(rows).contiguous().to(DEVICE),
        torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64).to(DEVICE),
    )


def small(dtype, limit=None):
    """The op's samples short of real vocabularies (those take minutes interpreted), at most ``limit`` elements."""
    found = [s for s in sample.samples(dtype, DEVICE, torch.Generator().manual_seed(0)) if not s.large]
    return [s for s in found if limit is None or s.args[0].numel() <= limit]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_samples_draw_the_reference_tokens(dtype):
    # interpreted: the CUDA target's wide blocks (4x fewer steps), the 128-row large-logits case in bf16 only (whose
    # rounding it is there to catch), and the native target's narrow blocks on the smallest samples in float32
    wide = CUDA if INTERPRETED else NATIVE
    for s in small(dtype, limit=None if dtype == torch.bfloat16 or not INTERPRETED else 64_000):
        assert check_reference_draws(sampler(wide), s.args) is None, s.label
    for s in small(dtype, limit=3200) if dtype == torch.float32 else ():
        assert check_reference_draws(sampler(NATIVE), s.args) is None, s.label


@pytest.mark.slow
def test_real_vocabularies_draw_the_reference_tokens():
    # bf16 only when interpreted: 32000 to 151936 tokens take seconds a call there
    for dtype in (torch.bfloat16,) if INTERPRETED else DTYPES:
        for s in sample.samples(dtype, DEVICE, torch.Generator().manual_seed(0)):
            if s.large:  # also the split-vocabulary path: the interpreter pretends to have only a few SMs
                assert check_reference_draws(sampler(CUDA if INTERPRETED else NATIVE), s.args) is None, s.label


@pytest.mark.slow
def test_samples_keep_the_rules_of_every_sampler():
    # allowed tokens, exact greedy rows, reproducible, a row's draw its own (Op.check runs the sampler 3 times)
    for s in small(torch.float32, limit=3200):
        assert sample.check(sampler(CUDA if INTERPRETED else NATIVE), s.args, torch.float32) is None, s.label


def test_error_inputs_raise():
    fn = sampler()
    for case in sample.errors(DEVICE):
        with pytest.raises(OpInputError, match=case.match):
            fn(*case.args)


@pytest.mark.parametrize(
    ("target", "dtype"),
    [(CUDA, torch.bfloat16), (ROCM, torch.float16), (XPU, torch.float32)],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_every_target_configuration_on_small_shapes(target, dtype):
    gen = torch.Generator().manual_seed(1)
    for s in sample.samples(dtype, DEVICE, gen)[:6]:  # up to 32 rows of 100 tokens
        assert check_reference_draws(sampler(target), s.args) is None, f"{target.name} {s.label}"


def test_provider_has_the_reference_signature():
    registry = OpRegistry([sample])
    fn = sampler()
    registry.register(Provider("sample", "triton_sample", fn), plugin="test", platform="test")
    assert inspect.signature(fn, eval_str=True) == sample.signature


def test_noise_is_the_reference_noise():
    seeds = torch.tensor([0, 1, -1, 2**62 + 12345, -(2**63), 2**63 - 1, 987654321], dtype=torch.int64, device=DEVICE)
    got = SamplingKernels(NATIVE).gumbel_noise(seeds, 3000)
    want = gumbel_noise(seeds, 3000)
    # the hash bits are equal; only the two logarithms may round differently
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_greedy_rows_equal_the_reference_lowest_id_on_ties(dtype):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 5, (24, 300), generator=gen).to(DEVICE, dtype)  # many ties at the maximum
    logits[5] = 0.0  # all equal: id 0
    logits[6, 299] = 100.0  # the last token
    args = batch(24, 300, 0.0, [0, 5] * 12, [1.0, 0.3] * 12)
    args = (logits, *args[1:])
    got = sampler()(*args)
    assert torch.equal(got, sample_reference(*args))
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert got[5] == 0 and got[6] == 299


@pytest.mark.slow
def test_draws_follow_softmax_of_logits_over_temperature():
    # 4000 seeds in one batched call, a chi-square test against softmax(logits / T) (7 degrees of freedom)
    n, temperature = 4000, 1.3
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -2.0], device=DEVICE).repeat(n, 1)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) * 7919 + 12345
    none_k, none_p = torch.zeros(n, dtype=torch.int32, device=DEVICE), torch.ones(n, device=DEVICE)
    tokens = sampler()(logits, torch.full((n,), temperature, device=DEVICE), none_k, none_p, seeds)
    counts = torch.bincount(tokens.cpu(), minlength=8).double()
    expected = n * torch.softmax(logits[0].cpu().double() / temperature, dim=0)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.32, (chi2, counts.tolist())  # the 0.999 quantile of chi-square(7)


@pytest.mark.slow
def test_top_k_and_top_p_restrict_the_distribution():
    # top-k 3 keeps tokens 4, 1, 6; top-p 0.6 keeps 4 and 1 (0.54 before 1): renormalised draws among them
    n = 2000
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 1.5, -2.0], device=DEVICE).repeat(n, 1)
    seeds = torch.arange(n, dtype=torch.int64, device=DEVICE) + 99
    temperature = torch.ones(n, device=DEVICE)
    for top_k, top_p, kept in ((3, 1.0, [4, 1, 6]), (0, 0.6, [4, 1])):
        k = torch.full((n,), top_k, dtype=torch.int32, device=DEVICE)
        p = torch.full((n,), top_p, device=DEVICE)
        tokens = sampler()(logits, temperature, k, p, seeds).cpu()
        counts = torch.bincount(tokens, minlength=8).double()
        assert set(tokens.unique().tolist()) == set(kept)
        probs = torch.softmax(logits[0, kept].cpu().double(), dim=0)
        chi2 = float(((counts[kept] - n * probs) ** 2 / (n * probs)).sum())
        assert chi2 < 16.27, (top_k, top_p, chi2)  # 0.999 quantile of chi-square(2) is 13.8, of (3) 16.27


def test_vocabulary_split_rule():
    assert _vocab_splits(1, 128256, 1024, 132) == (32, 4096)  # one row: 32 programs of 4096 tokens
    assert _vocab_splits(256, 128256, 1024, 132)[0] == 2
    assert _vocab_splits(512, 128256, 1024, 132)[0] == 1
    assert _vocab_splits(4, 1000, 256, 132)[0] == 1
    splits, chunk = _vocab_splits(3, 50000, 1024, 132)
    assert chunk % 1024 == 0 and (splits - 1) * chunk < 50000 <= splits * chunk
    assert math.ceil(50000 / chunk) == splits


def test_launcher_reads_no_tensor_values_on_the_host(monkeypatch):
    def refuse(self, *args):
        raise AssertionError("the launcher synchronised with the device")

    args = batch(4, 300, [0.0, 0.7, 1.0, 1.3], [0, 5, 0, 3], [1.0, 0.9, 0.5, 1.0])
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    tokens = sampler()(*args)
    monkeypatch.undo()
    assert torch.equal(tokens, sample_reference(*args))
