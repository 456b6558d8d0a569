"""The CPU providers against the contract: registration, every sample in every dtype, strided inputs, errors."""

import functools
import inspect

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import ALL_OPS, BindContext, OpRegistry
from vllm_port.ops.rotary import make_cos_sin_cache
from vllm_port_cpu import native, ops, sampling

OPS = {op.name: op for op in ALL_OPS}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPU = torch.device("cpu")
by_name = pytest.mark.parametrize("provider", ops.PROVIDERS, ids=lambda p: p.name)
by_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


@functools.cache
def samples(op_name, dtype):
    """The op's samples, made once per session: ``Op.check`` clones what it lets a provider mutate."""
    return tuple(OPS[op_name].samples(dtype, CPU, torch.Generator().manual_seed(0)))


def test_one_provider_per_op_each_with_the_reference_signature_and_all_bind_on_cpu():
    # the native kernels (test_cpu_native_attention.py, test_cpu_native_elementwise.py) sit above the torch
    # providers of their ops
    native_ops = {p.op for p in ops.PROVIDERS if p.name.startswith("cpu_native_")}
    assert native_ops == {
        "paged_attention",
        "prefill_attention",
        "reshape_and_cache",
        "rms_norm",
        "fused_add_rms_norm",
        "rotary_embedding",
        "silu_and_mul",
    }
    assert [p.op for p in ops.PROVIDERS if not p.name.startswith("cpu_native_")] == [op.name for op in ALL_OPS]
    registry = OpRegistry(ALL_OPS)
    for p in ops.PROVIDERS:
        registry.register(p, plugin="cpu", platform="cpu")
        is_native = p.name == f"cpu_native_{p.op}"
        assert (p.name == f"cpu_{p.op}" and p.priority == 10) or (is_native and p.priority > 10), p.name
        # names, kinds, defaults and annotations: the whole signature, not only what registration compares
        assert inspect.signature(p.fn, eval_str=True) == OPS[p.op].signature, p.name
    for dtype in DTYPES:
        bound = registry.bind(BindContext("cpu", "cpu", dtype))
        prefix = {op: "cpu_native_" if op in native_ops and native.available() else "cpu_" for op in OPS}
        assert {op: chosen.name for op, chosen in bound.providers.items()} == {op: f"{prefix[op]}{op}" for op in OPS}


@pytest.mark.slow
@by_name
@by_dtype
def test_provider_matches_the_float64_reference_on_every_sample(provider, dtype):
    op = OPS[provider.op]
    for sample in samples(op.name, dtype):
        assert op.check(provider.fn, sample.args, dtype) is None, sample.label


def _strided(value, pads):
    """A float tensor of 2+ dims as a column slice of a twice-as-wide buffer whose other half is NaN."""
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 1):
        return value
    wide = torch.full((*value.shape[:-1], 2 * value.shape[-1]), float("nan"), dtype=value.dtype)
    wide[..., : value.shape[-1]] = value
    pads.append(wide[..., value.shape[-1] :])
    return wide[..., : value.shape[-1]]


def on_strided_inputs(op, fn):
    """``fn`` called on strided copies of its arguments; what it mutates is copied back, the padding must stay NaN."""
    mutated = [i for i, name in enumerate(op.signature.parameters) if name in op.mutates]

    def call(*args):
        pads = []
        strided = [_strided(a, pads) for a in args]
        assert any(s is not a for s, a in zip(strided, args, strict=True))
        out = fn(*strided)
        for i in mutated:
            args[i].copy_(strided[i])
        assert all(bool(p.isnan().all()) for p in pads), "wrote outside the strided views"
        return out

    return call


@pytest.mark.slow
@by_name
@by_dtype
def test_provider_matches_the_reference_on_strided_inputs(provider, dtype):
    op = OPS[provider.op]
    small = [
        s
        for s in samples(op.name, dtype)
        if not s.label.startswith(("llama3", "longest")) and any(_strided(a, []) is not a for a in s.args)
    ]  # not the 1-D variants (x of one row without a row dimension): no column to slice
    assert small
    for sample in small:
        assert op.check(on_strided_inputs(op, provider.fn), sample.args, dtype) is None, sample.label


@by_name
def test_provider_refuses_error_inputs_with_the_reference_message(provider):
    for case in OPS[provider.op].errors(CPU):
        with pytest.raises(OpInputError) as refused:
            provider.fn(*case.args)
        assert case.match in str(refused.value), case.label
        with pytest.raises(OpInputError) as by_reference:
            OPS[provider.op].reference(*case.args)
        assert str(refused.value) == str(by_reference.value), case.label


@by_dtype
def test_sample_draws_the_reference_tokens_for_the_same_seeds(dtype):
    for sample in samples("sample", dtype):
        assert torch.equal(sampling.sample.fn(*sample.args), OPS["sample"].reference(*sample.args)), sample.label


def test_sample_with_new_seeds_draws_new_tokens_and_greedy_rows_stay_greedy():
    logits = torch.zeros(64, 1000)
    logits[:, 7] = 1.0
    temperature = torch.cat([torch.zeros(1), torch.full((63,), 100.0)])  # nearly uniform when sampled
    args = (temperature, torch.zeros(64, dtype=torch.int32), torch.ones(64))
    a = sampling.sample.fn(logits, *args, torch.arange(64))
    b = sampling.sample.fn(logits, *args, torch.arange(64) + 1000)
    assert a[0] == b[0] == 7
    assert a.unique().numel() > 30 and bool((a != b).any())


@by_dtype
def test_rotary_on_three_dimensional_query_and_key(dtype):
    op, gen = OPS["rotary_embedding"], torch.Generator().manual_seed(1)
    positions = torch.randint(0, 512, (6,), generator=gen, dtype=torch.int32)
    q = torch.randn(6, 8, 64, generator=gen).to(dtype)
    k = torch.randn(6, 2, 64, generator=gen).to(dtype)
    for rot, neox in ((64, True), (64, False), (32, True), (16, False)):
        args = (positions, q, k, 64, make_cos_sin_cache(512, rot), neox)
        assert op.check(ops.rotary_embedding.fn, args, dtype) is None, (rot, neox)


@by_dtype
def test_functional_ops_on_three_dimensional_inputs(dtype):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 64, generator=gen).to(dtype)
    w = torch.randn(48, 64, generator=gen).to(dtype)
    ones = torch.ones(64, dtype=dtype)
    assert OPS["linear"].check(ops.linear.fn, (x, w, None), dtype) is None
    assert OPS["rms_norm"].check(ops.rms_norm.fn, (x, ones, 1e-5), dtype) is None
    assert OPS["fused_add_rms_norm"].check(ops.fused_add_rms_norm.fn, (x, x.flip(0), ones, 1e-5), dtype) is None
    assert OPS["silu_and_mul"].check(ops.silu_and_mul.fn, (x,), dtype) is None
    assert OPS["gelu_and_mul"].check(ops.gelu_and_mul.fn, (x, "tanh"), dtype) is None
    ids = torch.randint(0, 48, (2, 3), generator=gen, dtype=torch.int32)
    assert OPS["embedding"].check(ops.embedding.fn, (ids, w), dtype) is None
