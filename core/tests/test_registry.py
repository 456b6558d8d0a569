"""The op registry: registration checks, binding by priority and support, preferences."""

import pytest
import torch

from vllm_port.errors import ProviderRejectedError, SelectionError
from vllm_port.ops import ALL_OPS, REFERENCE, BindContext, OpRegistry, provider


@provider("rms_norm", priority=10, dtypes=[torch.float32])
def fp32_only(x, weight, epsilon):
    return x


@provider("rms_norm", priority=20, supports=lambda ctx: "amx" in ctx.capabilities.get("isa", []))
def needs_amx(x, weight, epsilon):
    return x


@pytest.fixture
def registry():
    reg = OpRegistry(ALL_OPS)
    reg.register(fp32_only, plugin="p", platform="dev")
    reg.register(needs_amx, plugin="p", platform="dev")
    return reg


def ctx(dtype, isa=()):
    return BindContext("dev", "cpu", dtype, {"isa": list(isa)})


def test_highest_priority_supported_provider_wins_and_reference_is_last(registry):
    assert registry.bind(ctx(torch.float32, ["amx"])).providers["rms_norm"].name == "needs_amx"
    assert registry.bind(ctx(torch.float32)).providers["rms_norm"].name == "fp32_only"
    assert registry.bind(ctx(torch.bfloat16)).providers["rms_norm"].name == REFERENCE
    assert [p.name for p in registry.candidates("rms_norm", "dev")] == ["needs_amx", "fp32_only", REFERENCE]


def test_bound_attribute_is_the_provider_function_itself(registry):
    kernels = registry.bind(ctx(torch.float32))
    assert kernels.rms_norm is fp32_only.fn  # nothing between the caller and the kernel


def test_other_platforms_never_bind_foreign_providers(registry):
    kernels = registry.bind(BindContext("elsewhere", "cpu", torch.float32))
    assert all(p.name == REFERENCE for p in kernels.providers.values())


def test_preference_overrides_priority_and_bad_preferences_say_why(registry):
    assert registry.bind(ctx(torch.float32, ["amx"]), {"rms_norm": REFERENCE}).providers["rms_norm"].name == REFERENCE
    with pytest.raises(
        SelectionError, match="no provider named 'nope' on platform 'dev'; candidates: needs_amx, fp32_only, reference"
    ):
        registry.bind(ctx(torch.float32), {"rms_norm": "nope"})
    with pytest.raises(SelectionError, match="does not support torch.bfloat16"):
        registry.bind(ctx(torch.bfloat16), {"rms_norm": "fp32_only"})
    with pytest.raises(SelectionError, match="unknown ops"):
        registry.bind(ctx(torch.float32), {"rms_nrom": REFERENCE})


def test_duplicate_provider_name_is_refused(registry):
    with pytest.raises(ProviderRejectedError, match="already has a provider named 'fp32_only'"):
        registry.register(fp32_only, plugin="q", platform="dev")


def test_missing_op_attribute_lists_bound_ops(registry):
    with pytest.raises(
        AttributeError,
        match="no op named 'rms_nrom' is bound; bound ops: embedding, .*, rms_norm, rotary_embedding, sample, silu_and_mul",
    ):
        registry.bind(ctx(torch.float32)).rms_nrom  # noqa: B018


def test_env_preferences_reach_binding(monkeypatch):
    import vllm_port

    monkeypatch.setenv("VLLM_PORT_OP_PROVIDERS", "rms_norm=reference")
    assert vllm_port.load(plugins="cpu").bind(torch.float32).providers["rms_norm"].name == REFERENCE
    monkeypatch.setenv("VLLM_PORT_OP_PROVIDERS", "rms_norm")
    with pytest.raises(SelectionError, match="op=provider pairs"):
        vllm_port.load(plugins="cpu").bind(torch.float32)


def test_the_registry_only_resolves_and_the_runtime_decides_what_wraps_the_providers(monkeypatch):
    import vllm_port
    from vllm_port.ops.debug import CheckedOp

    monkeypatch.setenv("VLLM_PORT_CHECK", "1")  # debug mode is the runtime's business, never the registry's
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    resolved = runtime.registry.bind(runtime.bind_context(torch.float32))
    assert all(getattr(resolved, op) is p.fn for op, p in resolved.providers.items())  # the providers' own functions
    checked = runtime.bind(torch.float32)
    assert isinstance(checked.rms_norm, CheckedOp) and checked.providers == resolved.providers
    traced = runtime.bind(torch.float32, traceable=True)  # custom ops for torch.compile, left unchecked
    assert type(traced.rms_norm).__name__ == "CustomOpDef" and traced.rms_norm is traced.providers["rms_norm"].fn
    assert traced.candidates == resolved.candidates and traced.rms_norm._init_fn is resolved.rms_norm
