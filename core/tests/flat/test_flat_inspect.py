"""``vllm-port inspect``: the flat graph of a saved checkpoint of each family, as a table and as JSON."""

from __future__ import annotations

import json

import pytest
from cpu_providers import cpu_provider

from vllm_port.cli import main

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_json_lists_contract_nodes_with_providers_and_fusions(tiny_dirs, capsys, family):
    assert main(["inspect", str(tiny_dirs[family]), "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    layers = report["num_layers"]
    assert report["platform"] == "cpu" and report["phase"] == "decode" and report["dtype"] == "float32"
    kinds = {n["kind"] for n in report["nodes"]}
    assert kinds == {"contract", "native"}
    contract = [n for n in report["nodes"] if n["kind"] == "contract"]
    assert report["counts"]["contract"] == len(contract)
    assert report["counts"]["native"] == len(report["nodes"]) - len(contract)
    assert all(n["provider"].startswith("cpu_") for n in contract)
    assert all(n["provider"] == "torch" for n in report["nodes"] if n["kind"] == "native")
    assert report["fusions"]["fused_add_rms_norm"] == 2 * layers and report["fusions"]["silu_and_mul"] == layers
    ops = [n["op"] for n in contract]
    assert ops.count("paged_attention") == layers and "prefill_attention" not in ops
    prefill = report["graphs"]["prefill"]
    assert [n["op"] for n in prefill["nodes"]].count("prefill_attention") == layers
    assert prefill["digest"] != report["graphs"]["decode"]["digest"]


@pytest.mark.slow
def test_inspect_prints_a_table_and_the_stable_graph_text(tiny_dirs, capsys):
    assert main(["inspect", str(tiny_dirs["qwen2"]), "--device", "cpu", "--phase", "decode"]) == 0
    out = capsys.readouterr().out
    assert "(Qwen2ForCausalLM, 2 layers)  platform: cpu" in out
    assert f"cpu:{cpu_provider('fused_add_rms_norm')}" in out and "writes k_cache_1, v_cache_1" in out
    assert "fusions: x_sigmoid_to_silu x0, fused_add_rms_norm x4, silu_and_mul x2, gelu_and_mul x0" in out
    assert (
        main(["inspect", str(tiny_dirs["qwen2"]), "--device", "cpu", "--phase", "decode", "--graph", "--no-passes"])
        == 0
    )
    text = capsys.readouterr().out
    assert "flat graph decode(input_ids: [num_seqs] i64" in text and "aten.silu.default" in text
    assert "fusions: none run" in text


def test_inspect_names_the_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path), "--device", "cpu"]) == 2
    assert "config.json" in capsys.readouterr().err
