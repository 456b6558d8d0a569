"""What the importer refuses and what it proves, on tiny random ``transformers`` models (CPU, float32).

Each refusal is a model that would otherwise run wrong silently: a branch on the token count
frozen at the traced count, a sliding window applied through the mask alone, greedy tokens that
disagree within the logit tolerance. The in-place rotary proof is checked on the graph it rewrites.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tiny_models import build_tiny_model
from torch.fx.experimental.proxy_tensor import make_fx

from vllm_port import LLM
from vllm_port.importer import ImporterError, _verify, import_model
from vllm_port.importer._contract import contract_linear, contract_rotary, contract_rotary_rows
from vllm_port.importer._graph import writable
from vllm_port.importer._trace import _attention_function
from vllm_port.importer.report import render_import

# --- the tracer: size guards ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_branch_on_the_token_count_is_refused_not_frozen_at_the_traced_count(cpu_runtime):
    model = build_tiny_model("llama")
    mlp = model.model.layers[1].mlp
    plain = mlp.forward
    # traced at 13 tokens this is -plain(x); unrefused, a 30-token prompt would run -plain(x) too
    mlp.forward = lambda x: plain(x) if x.shape[1] > 20 else -plain(x)
    with pytest.raises(ImporterError, match=r"LlamaForCausalLM layers\.1 branches on its token count") as failure:
        import_model(model, cpu_runtime)
    message = str(failure.value)
    assert "`tokens <= 20`" in message  # the guard the trace recorded
    assert "x.shape[1] > 20" in message  # the source line that recorded it
    assert "torch.where" in message and "run this model with transformers itself" in message


# --- the import check ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sliding_window_applied_through_the_mask_alone_is_refused(cpu_runtime):
    model = build_tiny_model("mistral")  # window 8, passed to the attention function by every layer
    unwindowed = copy.copy(model.config)
    unwindowed.sliding_window = None  # the layers' attention now passes none; the top-level mask keeps 8
    for layer in model.model.layers:
        layer.self_attn.config = unwindowed
    with pytest.raises(
        ImporterError, match=r"MistralForCausalLM layers\.0 calls its attention with sliding window none, .* asks for 8"
    ):
        import_model(model, cpu_runtime)


@pytest.mark.slow
def test_per_layer_windows_are_checked_against_layer_types(cpu_runtime):
    model = build_tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    imported = import_model(model, cpu_runtime)  # a 12-token check: past the window of layer 1
    attention = [m.detail for m in imported.report.mapped if m.pattern == "attention"]
    assert ["sliding window 4" in d for d in attention] == [False, True]
    model.config.layer_types = ["sliding_attention", "sliding_attention"]  # what the layers do not do
    with pytest.raises(ImporterError, match=r"layers\.0 calls its attention with sliding window none, .* asks for 4"):
        import_model(model, cpu_runtime, verify=False)


@pytest.mark.slow
def test_the_import_check_wants_the_same_greedy_tokens_not_only_close_logits(cpu_runtime, monkeypatch):
    model = build_tiny_model("qwen2")
    base = model.model.forward

    def negated(*args, **kwargs):  # logits negated: the greedy token becomes the least likely one
        out = base(*args, **kwargs)
        out.last_hidden_state = -out.last_hidden_state
        return out

    model.model.forward = negated
    monkeypatch.setitem(_verify.VERIFY_TOLERANCE, torch.float32, 10.0)  # the logit error (2) passes
    with pytest.raises(ImporterError, match=r"greedy tokens differ at positions \[0, 1, 2, .*\] of 12"):
        import_model(model, cpu_runtime)


class _RecordingOps:
    """The bound ops, recording the shape of every KV cache ``reshape_and_cache`` writes."""

    def __init__(self, ops: Any, shapes: list[tuple[int, ...]]) -> None:
        self._ops, self._shapes = ops, shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        self._shapes.append(tuple(key_cache.shape))
        return self._ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@pytest.mark.slow
def test_the_import_check_uses_the_platforms_kv_block_size(cpu_runtime):
    shapes: list[tuple[int, ...]] = []
    runtime = SimpleNamespace(
        device=cpu_runtime.device,
        platform=dataclasses.replace(cpu_runtime.platform, kv_block_size=5),
        bind=lambda dtype: _RecordingOps(cpu_runtime.bind(dtype), shapes),
    )
    model = import_model(build_tiny_model("llama"), runtime)
    assert model.report.verify_error < 1e-4
    assert shapes and set(shapes) == {(3, 5, 1, 64)}  # 12 tokens in 3 blocks of 5


# --- the rewrite ---------------------------------------------------------------------------------------


def _traced_output(fn, *args) -> Any:
    """The node ``fn``'s first output is, in its pre-dispatch graph."""
    gm = make_fx(fn, pre_dispatch=True)(*args)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    return outs[0] if isinstance(outs, (tuple, list)) else outs


def test_the_in_place_proof_follows_views_and_split_pieces_and_stops_at_aliases():
    x, w = torch.randn(3, 8), torch.randn(16, 8)

    def heads(t):
        return t.view(1, 3, 2, 4).transpose(1, 2)

    assert writable(_traced_output(lambda x, w: heads(torch.nn.functional.linear(x, w)[:, :8]), x, w))
    # a piece of a split: disjoint from its sibling, which may be rotated in place too
    assert writable(_traced_output(lambda x, w: heads(torch.nn.functional.linear(x, w).split([8, 8], -1)[0]), x, w))
    # the projection is also read elsewhere: a write would be seen there
    shared = _traced_output(lambda x, w: (lambda y: (heads(y[:, :8]), y))(torch.nn.functional.linear(x, w)), x, w)
    assert not writable(shared)
    # an expand's broadcast elements share memory; an input is the caller's
    expanded = _traced_output(lambda x, w: torch.nn.functional.linear(x, w)[:1].expand(3, 16).reshape(3, 16), x, w)
    assert not writable(expanded)
    assert not writable(_traced_output(lambda x, w: heads(x), x, w))


@pytest.mark.slow
def test_rotary_is_proven_writable_on_the_fused_graph_it_rewrites(cpu_runtime):
    model = import_model(build_tiny_model("llama"), cpu_runtime)
    for layer in model.layers:
        # proven writable, so rotated in place on the rows of q and k (no copy: contract_rotary_rows has none)
        (rotary,) = [n for n in layer.graph.nodes if n.target in (contract_rotary, contract_rotary_rows)]
        assert rotary.target is contract_rotary_rows
        query, key = rotary.args[2], rotary.args[3]
        bases = []
        for node in (query, key):
            while node.target is not operator.getitem:
                node = node.args[0]
            bases.append(node.args[0].args[0])
        assert bases[0] is bases[1] and bases[0].target is contract_linear  # q and k: pieces of the fused q/k/v
        assert bases[0].args[2].target == "self_attn_q_proj_k_proj_v_proj_weight"


@pytest.mark.slow
def test_dtype_casts_left_native_are_reported(cpu_runtime):
    class SiluInFloat64(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.silu(x.double()).to(x.dtype)

    model = build_tiny_model("llama")
    model.model.layers[0].mlp.act_fn = SiluInFloat64()
    report = import_model(model, cpu_runtime).report
    casts = sorted(n["cast"] for n in report.native if "cast" in n)
    assert casts == ["float32 -> float64", "float64 -> float32"]
    assert all(n["piece"] == "layers.0" for n in report.native if "cast" in n)
    assert "(float32 -> float64) x1  in layers.0" in render_import(report.to_json())


# --- refusals that name the model and the fix ----------------------------------------------------------


@pytest.mark.slow
def test_a_layer_that_attends_twice_is_refused_naming_the_model(cpu_runtime):
    model = build_tiny_model("llama")
    attention = model.model.layers[0].self_attn
    once = attention.forward

    def twice(*args, **kwargs):
        return once(*args, **kwargs)[0] + once(*args, **kwargs)[0], None

    attention.forward = twice
    with pytest.raises(ImporterError, match=r"LlamaForCausalLM layers\.0 attends 2 times; .* transformers itself"):
        import_model(model, cpu_runtime, verify=False)


def test_non_causal_attention_is_refused_with_the_fix():
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ImporterError, match=r"non-causal .* causal-LM class \(AutoModelForCausalLM\)"):
        _attention_function(torch.nn.Identity(), q, q, q, None, is_causal=False)


def test_llm_checks_its_arguments_before_importing(cpu_runtime):
    model = build_tiny_model("llama")
    with pytest.raises(ValueError, match="placement of imported models is not supported yet"):
        LLM(model, device=cpu_runtime, placement={"lm_head": "cpu"})
    with pytest.raises(ValueError, match="block_size is 0"):
        LLM(model, device=cpu_runtime, dtype="bfloat16", block_size=0)
    with pytest.raises(ValueError, match="max_model_len is 1"):
        LLM(model, device=cpu_runtime, dtype="bfloat16", max_model_len=1)
    assert next(model.parameters()).dtype == torch.float32  # not cast: the import never ran
