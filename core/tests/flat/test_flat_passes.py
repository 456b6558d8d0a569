"""Fusion passes: they fire where the substitution is exact in meaning, and leave every other graph alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from vllm_port import flat
from vllm_port.flat.flat_graph import op_targets
from vllm_port.flat.passes import PassContext, apply_passes, core_passes, run_passes
from vllm_port.models import load_model

W = torch.linspace(0.5, 1.5, 16)
W_GATE_UP = torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) / 4


def _fused(cpu_runtime, fn, *args):
    """(counts, contract ops after, output before, output after) of core's passes on ``fn(ops, *args)``."""
    kernels = cpu_runtime.bind(torch.float32)
    ops = flat.traceable_ops(kernels)
    module = make_fx(lambda *a: fn(ops, *a), tracing_mode="fake", _allow_non_fake_inputs=True)(*args)
    before = module(*[a.clone() for a in args])
    fired = run_passes(module, PassContext(op_targets(kernels), "cpu", torch.float32), core_passes())
    after = module(*[a.clone() for a in args])
    remaining = [flat.contract_op(n) or str(n.target) for n in module.graph.nodes if n.op == "call_function"]
    return {k: v for k, v in fired.items() if v}, remaining, before, after


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_residual_add_then_norm_becomes_fused_add_rms_norm(cpu_runtime):
    def block(ops, x, h):
        residual = x * 2.0  # a fresh intermediate the fused op may overwrite
        s = ops.linear(h, W_GATE_UP[:16]) + residual
        return ops.rms_norm(s, W, 1e-6), s  # the sum is read again: it becomes the residual, updated in place

    fired, ops, before, after = _fused(cpu_runtime, block, _x(3, 16), _x(3, 16, seed=1))
    assert fired == {"fused_add_rms_norm": 1}
    assert "rms_norm" not in ops and "aten.add.Tensor" not in ops
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize(
    "case",
    ["residual is a graph input", "residual read after the norm", "sum read before the norm", "broadcast add"],
)
def test_add_norm_is_left_alone_where_an_in_place_add_would_change_results(cpu_runtime, case):
    def block(ops, x, r):
        if case == "residual is a graph input":
            return ops.rms_norm(x + r, W, 1e-6)
        if case == "residual read after the norm":
            fresh, other = r * 2.0, x * 3.0
            return ops.rms_norm(other + fresh, W, 1e-6) + fresh + other
        if case == "sum read before the norm":
            fresh = r * 2.0
            s = x * 3.0 + fresh
            early = s * 5.0
            return ops.rms_norm(s, W, 1e-6), early
        return ops.rms_norm(x * 2.0 + W, W, 1e-6)

    fired, ops, before, after = _fused(cpu_runtime, block, _x(3, 16), _x(3, 16, seed=1))
    assert fired == {} and "rms_norm" in ops
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize(
    ("act", "fused"),
    [
        (F.silu, ("silu_and_mul", "silu_and_mul")),
        (lambda g: g * torch.sigmoid(g), ("silu_and_mul", "silu_and_mul")),
        (F.gelu, ("gelu_and_mul", "gelu_and_mul")),
        (lambda g: F.gelu(g, approximate="tanh"), ("gelu_and_mul", "gelu_and_mul")),
    ],
    ids=["silu", "x*sigmoid(x)", "gelu", "gelu-tanh"],
)
def test_gated_mlp_over_a_chunk_becomes_one_op(cpu_runtime, act, fused):
    def mlp(ops, h):
        gate, up = ops.linear(h, W_GATE_UP).chunk(2, dim=-1)
        return act(gate) * up

    fired, ops, before, after = _fused(cpu_runtime, mlp, _x(5, 16))
    assert fired.get(fused[0]) == 1 and fused[1] in ops
    assert not {"aten.silu.default", "aten.gelu.default", "aten.mul.Tensor"} & set(ops)
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize("case", ["activation on the up half", "three chunks", "gate read elsewhere", "first dim"])
def test_gated_patterns_that_are_not_the_op_are_left_alone(cpu_runtime, case):
    def mlp(ops, y):
        if case == "activation on the up half":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(up) * gate
        if case == "three chunks":
            a, b, _ = y.chunk(3, dim=-1)
            return F.silu(a) * b
        if case == "gate read elsewhere":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up + gate
        gate, up = y.chunk(2, dim=0)
        return F.silu(gate) * up

    fired, ops, before, after = _fused(cpu_runtime, mlp, _x(6, 24))
    assert fired == {} and "aten.silu.default" in ops
    torch.testing.assert_close(after, before)


@pytest.mark.slow
def test_passes_on_the_model_fuse_every_layer(tiny_dirs, cpu_runtime):
    model = load_model(tiny_dirs["llama"], torch.device("cpu"), torch.float32)
    layers = model.config.num_layers
    for phase in flat.PHASES:
        graph = apply_passes(flat.trace(model, cpu_runtime.bind(torch.float32), phase=phase), cpu_runtime)
        assert graph.fusions == {
            "x_sigmoid_to_silu": 0,
            "fused_add_rms_norm": 2 * layers,  # after attention and after the MLP, the last one the final norm
            "silu_and_mul": layers,
            "gelu_and_mul": 0,
        }
        ops = [n.op for n in graph]
        assert ops.count("rms_norm") == 1  # the first layer's input norm has no residual add before it
        assert not {"aten.add.Tensor", "aten.silu.default", "aten.mul.Tensor"} & set(ops)
        assert (
            graph.counts()["native"]
            < flat.trace(model, cpu_runtime.bind(torch.float32), phase=phase).counts()["native"]
        )
