"""Ops contract: every provider the plugin registers, over every dtype it claims, against the float64 reference.

Cases are generated from the registry (see the plugin's ``pytest_generate_tests``): a provider
added to a plugin is checked without anyone listing it here. Every sample runs, even after one
fails, so a failure lists each case to replay; :meth:`vllm_port.ops.Op.check` says what each
sample checks (values, error statistics, output layout, writes through views, padding).
"""

from __future__ import annotations

import copy

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import Op, SampleInput
from vllm_port.ops._custom import as_custom_op
from vllm_port.ops.checks import validation

#: float8 dtypes (torch.allclose has no kernel for them)
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: A failure message quotes at most this many characters of each failing case's problem.
_PROBLEM_CHARS = 300


#: The first sample of each ``(op, dtype, device)``, as the reference check made it: samples are a function of
#: these and the seed alone, and the custom-op check, which runs on the first, would otherwise make them all again
_FIRST_SAMPLES: dict[tuple[str, torch.dtype, str], SampleInput] = {}


def _samples(op: Op, dtype: torch.dtype, device: torch.device) -> list[SampleInput]:
    """Every sample of ``op`` in ``dtype`` on ``device`` (seed 0); a copy of the first is kept for :func:`_first_sample`."""
    samples = list(op.samples(dtype, device, torch.Generator().manual_seed(0)))
    _FIRST_SAMPLES[(op.name, dtype, str(device))] = copy.deepcopy(samples[0])  # before any provider sees it
    return samples


def _first_sample(op: Op, dtype: torch.dtype, device: torch.device) -> SampleInput:
    """A fresh copy of ``op``'s first sample (copied with its layout: views stay views of one storage)."""
    first = _FIRST_SAMPLES.get((op.name, dtype, str(device)))
    return copy.deepcopy(first) if first is not None else _samples(op, dtype, device)[0]


def _who(provider, dtype) -> str:
    return f"plugin {provider.plugin!r}, provider {provider.name!r}, op {provider.op!r}, {dtype}"


def _run_case(op, provider, sample, dtype) -> str | None:
    """What is wrong with ``provider`` on ``sample``; an exception it raises is a failure of that case too."""
    try:
        return op.check(provider.fn, sample.args, dtype)
    except Exception as exc:  # a provider that raises on a valid input fails the case, with the reason
        return f"raised {type(exc).__name__}: {exc}"


def test_provider_matches_reference(plugin, provider_case):
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    samples = _samples(op, dtype, plugin.device)
    failures = []
    with validation():  # every sample is valid: the input checks that read values must accept it too
        for sample in samples:
            problem = _run_case(op, provider, sample, dtype)
            if problem is not None:
                failures.append(f"case {sample.label!r}: {problem[:_PROBLEM_CHARS]}")
    if failures:  # raised, not asserted: the report's message is then this text alone
        raise AssertionError(
            f"{_who(provider, dtype)}: {len(failures)} of {len(samples)} cases fail: " + " | ".join(failures)
        )


def test_provider_refuses_error_inputs(plugin, provider_case):
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    for case in op.errors(plugin.device):
        with pytest.raises(OpInputError) as info:
            provider.fn(*case.args)
        assert case.match in str(info.value), f"{_who(provider, dtype)} refused {case.label!r} unclearly: {info.value}"


def test_provider_refuses_out_of_range_values(plugin, provider_case):
    """Under validation (``vllm_port.ops.checks``: off in production, as it reads tensor values), every provider
    refuses the op's value errors: an id past the vocabulary, a slot or block past the cache, a bad length."""
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    for case in op.value_errors(plugin.device):
        with validation(), pytest.raises(OpInputError) as info:
            provider.fn(*case.args)
        assert case.match in str(info.value), f"{_who(provider, dtype)} refused {case.label!r} unclearly: {info.value}"


def test_provider_traces_as_a_custom_op(plugin, provider_case):
    """torch.library.opcheck: schema, fake implementation and declared mutations agree with the kernel.

    Run on the first sample; output layout on every sample is checked by ``Op.check`` (contiguous,
    as the op's fake implementation promises).
    """
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    sample = _first_sample(op, dtype, plugin.device)
    # torch's schema check compares arguments with allclose, which float8 tensors lack (fp8_linear's weight):
    # there the fake tensor test runs alone, and the op's own check finds writes to what it only reads.
    fp8 = any(isinstance(a, torch.Tensor) and a.dtype in _FP8_DTYPES for a in sample.args)
    tests = ("test_faketensor",) if fp8 else ("test_schema", "test_faketensor")
    torch.library.opcheck(as_custom_op(op, provider), sample.args, test_utils=tests)
