"""Ops contract: every provider the plugin registers, over every dtype it claims, against the float64 reference.

Cases are generated from the registry (see the plugin's ``pytest_generate_tests``): a provider
added to a plugin is checked without anyone listing it here.
"""

from __future__ import annotations

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops._custom import as_custom_op


def _who(provider, dtype) -> str:
    return f"plugin {provider.plugin!r}, provider {provider.name!r}, op {provider.op!r}, {dtype}"


def test_provider_matches_reference(plugin, provider_case):
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    gen = torch.Generator().manual_seed(0)
    for sample in op.samples(dtype, plugin.device, gen):
        problem = op.check(provider.fn, sample.args, dtype)
        assert problem is None, f"{_who(provider, dtype)}, case {sample.label!r}: {problem}"


def test_provider_refuses_error_inputs(plugin, provider_case):
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    for case in op.errors(plugin.device):
        with pytest.raises(OpInputError) as info:
            provider.fn(*case.args)
        assert case.match in str(info.value), f"{_who(provider, dtype)} refused {case.label!r} unclearly: {info.value}"


def test_provider_traces_as_a_custom_op(plugin, provider_case):
    """torch.library.opcheck: schema, fake implementation and declared mutations agree with the kernel."""
    provider, dtype = provider_case
    plugin.require_device()
    op = plugin.discovery.registry.ops[provider.op]
    sample = op.samples(dtype, plugin.device, torch.Generator().manual_seed(0))[0]
    torch.library.opcheck(as_custom_op(op, provider), sample.args, test_utils=("test_schema", "test_faketensor"))
