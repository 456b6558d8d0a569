"""Flat graphs traced from the Llama-family model: nodes, shapes, layers, a stable text form, and eager runs."""

from __future__ import annotations

import pytest
import torch
from paged_harness import Conversation, assert_fp32_close

from vllm_port import flat
from vllm_port.flat.passes import apply_passes
from vllm_port.models import load_model

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(d, torch.device("cpu"), torch.float32) for f, d in tiny_dirs.items()}


def test_decode_graph_is_contract_ops_with_named_weights_shapes_and_layers(models, cpu_runtime):
    model = models["llama"]
    graph = flat.trace(model, cpu_runtime.bind(torch.float32), phase="decode", block_size=4)
    ops = [n.op for n in graph if n.kind == "contract"]
    assert ops.count("paged_attention") == ops.count("reshape_and_cache") == model.config.num_layers
    assert "prefill_attention" not in ops
    assert {"embedding", "rms_norm", "linear", "rotary_embedding"} <= set(ops)
    qkv = next(n for n in graph if n.op == "linear")
    assert qkv.provider == "cpu_linear" and qkv.plugin == "cpu"
    assert qkv.inputs == ("%rms_norm", "$layers.0.qkv_weight") and qkv.layer == 0
    assert qkv.shapes == (f"[num_seqs, {model.config.q_size + 2 * model.config.kv_size}] f32",)
    rotary = next(n for n in graph if n.op == "rotary_embedding")
    assert rotary.outputs == () and len(rotary.mutates) == 2 and dict(rotary.attrs)["head_size"] == 64
    cache_write = next(n for n in graph if n.op == "reshape_and_cache")
    assert cache_write.mutates == ("k_cache_0", "v_cache_0")
    assert [n.layer for n in graph if n.op == "paged_attention"] == [0, 1]
    assert graph.nodes[0].op == "embedding" and graph.nodes[0].layer is None
    assert graph.counts()["contract"] == len(ops) and graph.counts()["native"] > 0


@pytest.mark.slow
def test_two_builds_print_the_same_and_phases_differ(models, cpu_runtime):
    kernels = cpu_runtime.bind(torch.float32)
    first = flat.trace(models["qwen2"], kernels, phase="prefill")
    again = flat.trace(models["qwen2"], kernels, phase="prefill")
    assert first == again and first.digest() == again.digest() and first.text() == again.text()
    assert "prefill_attention(" in first.text() and "[num_tokens, 256] f32" in first.text()
    assert "max_query_len: max_query_len" in first.text()  # a symbol: one graph serves every batch
    decode = flat.trace(models["qwen2"], kernels, phase="decode")
    assert decode != first
    assert "$layers.1.qkv_bias" in decode.text()  # Qwen2's q/k/v bias is a weight the linear reads
    reference = flat.trace(models["qwen2"], cpu_runtime.bind(torch.float32, prefer={"linear": "reference"}))
    assert reference != decode and reference.text(providers=False) == decode.text(providers=False)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_eager_graph_before_and_after_passes_is_the_model(models, tiny_dirs, cpu_runtime, family):
    model = models[family]
    kernels = cpu_runtime.bind(torch.float32)
    traced = {p: flat.trace(model, kernels, phase=p, block_size=4) for p in flat.PHASES}
    fused = {p: apply_passes(g, cpu_runtime) for p, g in traced.items()}
    for graphs in (traced, fused):
        talk = Conversation(model.config, [9, 14], decode_steps=3)  # 14 tokens: past Mistral's window of 8
        ids, pos, meta = talk.prefill()
        hidden = graphs["prefill"](*flat.graph_inputs(ids, pos, talk.kv_caches, meta))
        assert_fp32_close(model.compute_logits(kernels, hidden), talk.expected_prefill(tiny_dirs[family]))
        for step in range(3):
            ids, pos, meta = talk.decode(step)
            hidden = graphs["decode"](*flat.graph_inputs(ids, pos, talk.kv_caches, meta))
            assert_fp32_close(model.compute_logits(kernels, hidden), talk.expected_decode(tiny_dirs[family], step))


def test_untraceable_model_is_refused_with_its_name(cpu_runtime):
    class HostRead:
        class config:  # noqa: N801
            num_layers, num_kv_heads, head_size = 1, 1, 8

        def forward(self, ops, input_ids, positions, kv_caches, meta):
            return torch.zeros(int(input_ids.sum()))  # a host read of a value: no graph can hold it

    with pytest.raises(flat.TraceError, match=r"HostRead.forward \(decode\) could not be traced"):
        flat.trace(HostRead(), cpu_runtime.bind(torch.float32))
    with pytest.raises(flat.TraceError, match="phase must be one of"):
        flat.trace(HostRead(), cpu_runtime.bind(torch.float32), phase="both")
