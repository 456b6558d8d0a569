"""The sampling contract's own checks: they admit every correct sampler and refuse wrong ones.

Correct samplers here round differently from the reference (as other devices do) or draw from a
generator of their own (a statistical sampler); wrong ones are the reference with one argument
misapplied. The conformance suite runs the same checks on plugins (``checks/test_sampling.py``), and
``conformance/tests/mutants_sampling.py`` certifies wrong samplers end to end.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm_port.ops import Provider, sample
from vllm_port.ops.sampling import (
    TOP_P_SLACK,
    acceptable_draws,
    check_draw_distribution,
    check_reference_draws,
    distribution_samples,
    filled_truncation,
    gumbel_noise,
    hash32,
    reference_probabilities,
    sample_reference,
)

CPU = torch.device("cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def samples(dtype):
    return sample.samples(dtype, CPU, torch.Generator().manual_seed(0))


def small(dtype):
    """The samples short of real vocabularies (those cost a few tenths of a second a call)."""
    return [s for s in samples(dtype) if not s.large]


def sampler(*, scale=None, noise=None, k_shift=0, temperature_factor=1.0, top_p_mass=torch.float32):
    """``sample_reference`` rebuilt with one part swapped: how scores are scaled, the noise, top-k, the top-p sum."""

    def fn(logits, temperature, top_k, top_p, seeds):
        top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
        t = torch.where(temperature > 0, temperature * temperature_factor, 1.0)
        scores = scale(logits, t) if scale else logits.float() / t[:, None]
        vocab = logits.shape[1]
        ordered, order = scores.sort(dim=-1, descending=True, stable=True)
        k = torch.where(top_k > 0, top_k.long() + k_shift, vocab).clamp(1, vocab)
        drop = torch.arange(vocab)[None, :] >= k[:, None]
        probs = torch.softmax(ordered.to(top_p_mass).masked_fill(drop, float("-inf")), dim=-1)
        drop |= (probs.flip(-1).cumsum(-1).flip(-1) <= 1 - top_p[:, None].to(top_p_mass)) & (top_p < 1)[:, None]
        drop[:, 0] = False
        dropped = torch.empty_like(drop).scatter_(1, order, drop)
        drawn = (scores.masked_fill(dropped, float("-inf")) + (noise or gumbel_noise)(seeds, vocab)).argmax(dim=-1)
        return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))

    return fn


def reciprocal_scale(logits, temperature):
    return logits.float() * (1.0 / temperature)[:, None]  # one rounding more than x / T


def noise_through_float64(seeds, vocab):
    """The contract's noise with both logs taken in float64 (correctly rounded), where torch's float32 log is not."""
    mask = 0xFFFFFFFF
    key = hash32((seeds & mask) ^ hash32((seeds >> 32) & mask))
    bits = hash32(key[:, None] ^ hash32(torch.arange(vocab))[None, :]) >> 8
    return (-torch.log(-torch.log((bits.double() + 0.5) / 2**24))).float()


def own_noise(seeds, vocab, row_keyed=False):
    """Gumbel noise of a counter-based generator other than the contract's, keyed by the seed (and the row)."""
    key = hash32(((seeds ^ (seeds >> 29)) & 0xFFFFFFFF) ^ 0x2545F491)
    if row_keyed:
        key = hash32(key ^ torch.arange(len(seeds)))
    ids = (torch.arange(vocab) * 0x9E3779B1) & 0xFFFFFFFF
    bits = hash32(hash32(key[:, None] ^ ids[None, :]) ^ 0x68E31DA4) >> 8
    return -torch.log(-torch.log((bits.float() + 0.5) / 2**24))


def test_a_provider_is_bitwise_unless_it_says_otherwise():
    assert Provider("sample", "x", sample_reference).equivalence == "bitwise"


def test_another_rounding_is_still_bitwise_and_only_near_ties_admit_another_token():
    # the top-p mass summed from the tail in float32 (not from the head), x * (1 / T), and a noise whose logs
    # were taken in other precisions: every draw is still the reference's, or a rounding away from it
    correct = sampler(scale=reciprocal_scale, noise=noise_through_float64)
    for dtype in DTYPES:
        for s in samples(dtype) if dtype == torch.float32 else small(dtype):
            assert check_reference_draws(correct, s.args) is None, (dtype, s.label)
    rows = sum(s.args[0].shape[0] for s in samples(torch.float32))
    ambiguous = sum(int((acceptable_draws(*s.args).sum(dim=-1) > 1).sum()) for s in small(torch.float32))
    assert ambiguous <= rows // 200, (ambiguous, rows)


@pytest.mark.parametrize(
    ("wrong", "dtype"),
    [
        (sampler(temperature_factor=1.05), torch.float32),
        (sampler(scale=lambda logits, t: (logits / t[:, None].to(logits.dtype)).float()), torch.bfloat16),
        (sampler(k_shift=1), torch.float16),
        (sampler(k_shift=-1), torch.float32),
        (sampler(noise=lambda seeds, vocab: gumbel_noise(seeds + 1, vocab)), torch.float32),
        (sampler(noise=own_noise), torch.bfloat16),
    ],
    ids=["temperature 5% off", "scores divided in bf16", "top-k + 1", "top-k - 1", "seed + 1", "own generator"],
)
def test_a_sampler_off_in_one_argument_is_not_bitwise(wrong, dtype):
    refused = (s.label for s in small(dtype) if check_reference_draws(wrong, s.args) is not None)
    assert next(refused, None) and next(refused, None), "refused by fewer than two samples"  # not by luck


def test_the_failure_names_the_row_its_arguments_and_both_tokens():
    s = next(s for s in samples(torch.float32) if s.label == "temperature per row")
    problem = check_reference_draws(sampler(temperature_factor=0.5), s.args)
    row = r"row \d+ \(temperature [0-9.]+, top_k 0, top_p 1, seed -?\d+\) drew token \d+, whose perturbed score"
    assert re.match(row, problem), problem
    assert "the reference draws" in problem and "equivalence='statistical'" in problem, problem


def test_every_sampler_rule_refuses_its_violation():
    s = next(s for s in samples(torch.float32) if s.label == "mixed batch")

    def greedy_last(logits, temperature, top_k, top_p, seeds):
        drawn = sample_reference(logits, temperature, top_k, top_p, seeds)
        return torch.where(temperature > 0, drawn, logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1))

    ties = next(s for s in samples(torch.float32) if s.label.startswith("greedy, ties"))
    assert "is greedy (temperature 0)" in sample.check(greedy_last, ties.args, torch.float32)
    unseeded = sampler(noise=lambda seeds, vocab: -torch.log(-torch.log(torch.rand(len(seeds), vocab))))
    assert "two calls with the same seeds" in sample.check(unseeded, s.args, torch.float32)
    for leaky in (sampler(noise=lambda seeds, v: own_noise(seeds, v, row_keyed=True)), sampler(noise=own_noise_summed)):
        assert "its own seed unchanged" in sample.check(leaky, s.args, torch.float32)
    assert "exclude" in sample.check(sampler(k_shift=1), s.args, torch.float32)


def own_noise_summed(seeds, vocab):
    return own_noise(seeds + seeds.roll(1), vocab)  # the previous request's seed leaks in


def test_a_statistical_sampler_keeps_every_rule_and_fits_the_distribution():
    statistical = sampler(noise=own_noise)
    for s in small(torch.bfloat16):
        assert sample.check(statistical, s.args, torch.bfloat16) is None, s.label
    for case in distribution_samples(torch.float32, CPU):
        assert check_draw_distribution(statistical, case.args) is None, case.label


def test_the_reference_fits_its_own_distribution():
    for case in distribution_samples(torch.bfloat16, CPU):
        assert check_draw_distribution(sample_reference, case.args) is None, case.label


@pytest.mark.parametrize(
    ("wrong", "case"),
    [
        (sampler(noise=own_noise, temperature_factor=1.05), "temperature 0.7"),
        (sampler(noise=own_noise, temperature_factor=0.95), "temperature 1.5"),
        (sampler(noise=own_noise, k_shift=-1), "top-k 5"),
        (sampler(noise=own_noise, k_shift=1), "top-k 5"),
        (sampler(noise=lambda seeds, vocab: own_noise(seeds * 0, vocab)), "temperature 0.7"),
    ],
    ids=["temperature 5% high", "temperature 5% low", "top-k - 1", "top-k + 1", "seed ignored"],
)
def test_the_distribution_check_catches_small_errors(wrong, case):
    args = next(c.args for c in distribution_samples(torch.float32, CPU) if c.label == case)
    problem = check_draw_distribution(wrong, args)
    assert problem is not None and ("G-test" in problem or "exclude" in problem), problem


def test_the_distribution_cases_suit_a_chi_square_test():
    # every kept token expected at least 5 times (the G statistic is then chi-square distributed), and no top-p
    # edge within 0.01 of its threshold, so rounding cannot move a token in or out
    for case in distribution_samples(torch.float16, CPU):
        logits, temperature, top_k, top_p, _ = (None if a is None else a[:1] for a in case.args)
        top_k, top_p = filled_truncation(top_k, top_p, 1, logits.device)
        probs = reference_probabilities(logits, temperature, top_k, top_p)[0]
        draws = case.args[0].shape[0]
        assert float(draws * probs[probs > 0].min()) >= 5, case.label
        full = reference_probabilities(logits, temperature, top_k, torch.ones(1))[0].sort(descending=True).values
        before = full.cumsum(0) - full
        assert bool(((before - float(top_p)).abs() > 0.01 + TOP_P_SLACK).all()) or float(top_p) >= 1, case.label
