"""Ops contract: every provider the plugin registers, over every dtype it claims, against the float64 reference."""

from __future__ import annotations

import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import compare


def test_provider_matches_reference(plugin, provider_case):
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    gen = torch.Generator().manual_seed(0)
    for sample in op.samples(dtype, plugin.device, gen):
        problem = compare(op, sample.args, provider.fn(*sample.args), dtype)
        assert problem is None, (
            f"plugin {provider.plugin!r}, provider {provider.name!r}, op {op.name!r}, {dtype}, case {sample.label!r}: {problem}"
        )


def test_provider_refuses_error_inputs(plugin, provider_case):
    provider, _ = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    for case in op.errors(plugin.device):
        try:
            provider.fn(*case.args)
        except OpInputError as exc:
            assert case.match in str(exc), (
                f"provider {provider.name!r} refused {case.label!r} with an unclear message: {exc}"
            )
        else:
            raise AssertionError(
                f"provider {provider.name!r} of op {op.name!r} accepted {case.label!r}; it must raise OpInputError"
            )
