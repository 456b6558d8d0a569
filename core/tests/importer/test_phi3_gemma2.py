"""The importer's stretch families on tiny random ``transformers`` models (CPU, float32): Phi-3 and Gemma-2.

Phi-3 stores q/k/v and gate/up fused in its checkpoint; Gemma-2 scales its embeddings, norms by
``1 + weight`` before and after attention and MLP, gates with GELU-tanh, soft-caps attention and
the final logits and alternates windowed layers. Greedy equality with ``transformers`` through the
engine is in ``test_importer.py``; this file checks what was recognised, what stayed native and why,
and the refusals.
"""

from __future__ import annotations

import json
import operator
from collections import Counter

import pytest
import torch
from tiny_models import build_tiny_model, save_tiny_model

from vllm_port import LLM, SamplingParams
from vllm_port.cli import main
from vllm_port.importer import ImporterError, import_model
from vllm_port.importer._contract import contract_rotary, contract_rotary_rows


def per_layer(report) -> Counter:
    return Counter((m.piece, m.pattern) for m in report.mapped)


# --- Phi-3 ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_phi3_fused_projections_are_recognised_by_what_the_graph_computes(cpu_runtime):
    model = import_model(build_tiny_model("phi3"), cpu_runtime)
    report = model.report
    counts = per_layer(report)
    for i in range(2):
        assert counts[f"layers.{i}", "linear"] == 4  # qkv_proj, o_proj, gate_up_proj, down_proj as stored
        assert counts[f"layers.{i}", "rms_norm"] == 2
        assert counts[f"layers.{i}", "rotary_embedding"] == counts[f"layers.{i}", "attention"] == 1
    gated = [m for m in report.mapped if m.pattern == "gated_mlp"]
    assert [m.ops for m in gated] == [("silu_and_mul",)] * 2  # gate_up_proj(x).chunk(2): act(first) * second
    assert all("mlp.gate_up_proj.weight" in m.detail for m in gated)
    assert not any(n.startswith("layers.0: fused") for n in report.to_json()["notes"])  # nothing to fuse
    # the residual dropouts (eval) and the concatenation with the empty part past the rotary are gone
    assert Counter(n["op"] for n in report.native) == {"aten.add.Tensor": 4}
    # q and k are slices of one qkv projection, disjoint from v: rotated in place, no copy, on the
    # projection's rows (the slices became pieces of one split, so CUDA's rotary/cache fusion sees them)
    for layer in model.layers:
        assert not [n for n in layer.graph.nodes if n.target is contract_rotary]
        (rotary,) = [n for n in layer.graph.nodes if n.target is contract_rotary_rows]
        query_rows, key_rows = rotary.args[2:4]
        assert query_rows.target is key_rows.target is operator.getitem
        assert query_rows.args[0] is key_rows.args[0] and (query_rows.args[1], key_rows.args[1]) == (0, 1)
        split = query_rows.args[0]
        assert split.args[1:] == ([192, 96, 96], -1)  # q: 2 heads of 96, k and v: 1 head each
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_size) == (2, 1, 96)


def _longrope(original: int, max_positions: int) -> dict:
    half = 96 // 2
    return dict(
        max_position_embeddings=max_positions,
        original_max_position_embeddings=original,
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [2.0 + 0.2 * i for i in range(half)],
        },
    )


@pytest.mark.slow
def test_phi3_longrope_is_served_up_to_where_its_short_factors_hold(cpu_runtime):
    model = build_tiny_model("phi3", **_longrope(original=128, max_positions=512))
    prompt = torch.randint(5, 500, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():  # 30 + 64 < 128: transformers uses the short factors throughout
        want = model.generate(torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert len(set(want[0, 30:].tolist())) >= 16  # a live model, not one stuck on a few tokens
    llm = LLM(model, device=cpu_runtime)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == want[0, 30:].tolist()
    imported = llm.runner.model
    assert imported.config.max_position_embeddings == 128  # past it transformers switches to the long factors
    assert any(
        "served up to 128 of the config's max_position_embeddings 512" in n for n in imported.report.to_json()["notes"]
    )
    assert llm.max_model_len <= 128


def test_a_rotary_whose_table_depends_on_the_sequence_length_is_refused_naming_the_rope_type(cpu_runtime):
    model = build_tiny_model("phi3")
    rotary = model.model.rotary_emb
    plain = rotary.forward

    def stretched(x, position_ids):  # angles scaled by the sequence length, at every length
        cos, sin = plain(x, position_ids * (1.0 + 1.0 / position_ids.shape[-1]))
        return cos, sin

    rotary.forward = stretched
    with pytest.raises(
        ImporterError,
        match=r"Phi3ForCausalLM: its rotary embedding \(Phi3RotaryEmbedding, rope type "
        r"'default'\) .* depend on the sequence length",
    ) as failure:
        import_model(model, cpu_runtime)
    assert "longrope up to its original_max_position_embeddings" in str(failure.value)


# --- Gemma-2 -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma2_maps_its_norms_mlp_and_capped_attention_and_keeps_the_rest_native(cpu_runtime):
    model = import_model(build_tiny_model("gemma2"), cpu_runtime)
    report = model.report
    counts = per_layer(report)
    for i in range(2):
        assert counts[f"layers.{i}", "rms_norm"] == 4  # input, post-attention, pre- and post-feedforward
        assert counts[f"layers.{i}", "gated_mlp"] == counts[f"layers.{i}", "attention"] == 1
    assert counts["norm", "rms_norm"] == 1
    # (1 + w) norm weights are folded once at import: the op gets one weight
    norms = [m.detail for m in report.mapped if m.pattern == "rms_norm"]
    assert all(".folded" in d for d in norms)
    assert any("input_layernorm.weight through to.dtype, add.Tensor" in n for n in report.to_json()["notes"])
    assert {m.ops for m in report.mapped if m.pattern == "gated_mlp"} == {("gelu_and_mul",)}
    assert all("approximate=tanh" in m.detail for m in report.mapped if m.pattern == "gated_mlp")
    attention = [m.detail for m in report.mapped if m.pattern == "attention"]
    assert ["sliding window 8" in d for d in attention] == [True, False]  # layer_types alternate
    assert all("soft cap 2" in d for d in attention)
    # native: the residual adds, the embedding scale, the final logit soft cap after the LM head
    native = Counter((n["piece"], n["op"]) for n in report.native)
    assert native == {
        ("layers.0", "aten.add.Tensor"): 2,
        ("layers.1", "aten.add.Tensor"): 2,
        ("embed", "aten.mul.Tensor"): 1,
        ("lm_head", "aten.div.Tensor"): 1,
        ("lm_head", "aten.tanh.default"): 1,
        ("lm_head", "aten.mul.Tensor"): 1,
    }
    assert report.verify_error < 1e-4
    # the cap acts: logits of large hidden states stay within +-5
    ops = cpu_runtime.bind(torch.float32)
    logits = model.compute_logits(ops, 10 * torch.randn(5, model.config.hidden_size))
    assert logits.shape == (5, 512) and float(logits.abs().max()) <= 5.0


@pytest.mark.slow
def test_inspect_import_lists_gemma2s_soft_cap_as_native_nodes_after_the_lm_head(tmp_path, capsys):
    path = save_tiny_model("gemma2", tmp_path / "gemma2")
    assert main(["inspect", str(path), "--import", "--device", "cpu", "--phase", "decode"]) == 0
    text = capsys.readouterr().out
    assert "import of Gemma2ForCausalLM" in text and "native torch nodes (not views): 8" in text
    assert "aten.tanh.default x1  in lm_head" in text and "aten.mul.Tensor x2  in embed, lm_head" in text
    assert main(["inspect", str(path), "--import", "--device", "cpu", "--phase", "decode", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {(n["piece"], n["op"]) for n in report["import"]["native"]} >= {("lm_head", "aten.tanh.default")}


@pytest.mark.slow
def test_a_causal_lm_forward_that_cannot_be_traced_falls_back_to_the_head_module(cpu_runtime):
    model = build_tiny_model("llama")
    plain = model.forward

    def host_read(*args, **kwargs):  # what the importer cannot trace: a value read on the host
        out = plain(*args, **kwargs)
        assert float(out.logits.abs().sum()) >= 0
        return out

    model.forward = host_read
    imported = import_model(model, cpu_runtime)
    notes = imported.report.to_json()["notes"]
    assert any(n.startswith("lm_head: the causal LM's forward after its base model could not be traced") for n in notes)
    assert imported.report.verify_error < 1e-4
