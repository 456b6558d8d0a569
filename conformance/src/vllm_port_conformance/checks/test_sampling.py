"""Sampling contract: every sampler the plugin registers reproduces the reference as its equivalence says.

``test_ops`` checks what every sampler must do on each sample (allowed tokens, exact greedy rows,
draws that follow a row's own seed). Here, per provider of ``sample`` and dtype it claims: a
``"bitwise"`` sampler draws the reference's tokens from the same seeds on every sample
(:func:`~vllm_port.ops.sampling.check_reference_draws`); a ``"statistical"`` one draws from the
reference's distribution (a G-test, :func:`~vllm_port.ops.sampling.check_draw_distribution`).
Ids are ``test_ops``'s (``op-provider-dtype``); a failure names the equivalence it was held to.
Every case runs, even after one fails, so a failure lists each case to replay.
A plugin without a sampler is served by the reference on its device, which is checked instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_port.ops import REFERENCE, Provider
from vllm_port.ops.sampling import (
    EQUIVALENCES,
    check_draw_distribution,
    check_reference_draws,
    distribution_samples,
)
from vllm_port_conformance.plugin import plugin_under_test

#: A failure message quotes at most this many characters of each failing case's problem.
_PROBLEM_CHARS = 600


def _sampler_cases(config: pytest.Config) -> list[Any]:
    put = plugin_under_test(config)
    if put is None:
        return []
    samplers = [p for p in put.record.providers if p.op == "sample"]
    if not samplers:  # binding falls back to the reference, run on the plugin's device
        op = put.discovery.registry.ops["sample"]
        samplers = [Provider("sample", REFERENCE, op.reference, dtypes=op.dtypes, plugin=put.record.name)]
    return [
        pytest.param((p, dtype), id=f"sample-{p.name}-{str(dtype).removeprefix('torch.')}")
        for p in samplers
        for dtype in sorted(p.dtypes, key=str)
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sampler_case" in metafunc.fixturenames:
        cases = _sampler_cases(metafunc.config)
        metafunc.parametrize("sampler_case", cases or [pytest.param(None, marks=pytest.mark.skip(reason="no plugin"))])


def test_sampler_equivalence(plugin, sampler_case):
    provider, dtype = sampler_case
    plugin.require_device()
    who = f"plugin {provider.plugin!r}, provider {provider.name!r}, op 'sample', {dtype}, {provider.equivalence}"
    assert provider.equivalence in EQUIVALENCES, (
        f"{who} declares equivalence {provider.equivalence!r}; declare one of {', '.join(EQUIVALENCES)}"
    )
    if provider.equivalence == "bitwise":
        op = plugin.discovery.registry.ops["sample"]
        cases, check = op.samples(dtype, plugin.device, torch.Generator().manual_seed(0)), check_reference_draws
    else:
        cases, check = distribution_samples(dtype, plugin.device), check_draw_distribution
    failures = []
    for case in cases:
        try:
            problem = check(provider.fn, case.args)
        except Exception as exc:  # a sampler that raises on a valid input fails the case, with the reason
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem is not None:
            failures.append(f"case {case.label!r}: {problem[:_PROBLEM_CHARS]}")
    assert not failures, f"{who}: {len(failures)} of {len(cases)} cases fail: " + " | ".join(failures)
