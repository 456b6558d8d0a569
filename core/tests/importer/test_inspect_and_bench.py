"""``vllm-port inspect MODEL_DIR --import`` and the importer benchmark, on tiny models (CPU)."""

from __future__ import annotations

import json

from tiny_models import save_tiny_model

from vllm_port.bench import importer as bench
from vllm_port.cli import main


def test_inspect_import_lists_mapped_subgraphs_and_native_nodes(tmp_path, capsys):
    path = save_tiny_model("llama", tmp_path / "llama")
    assert main(["inspect", str(path), "--import", "--device", "cpu", "--phase", "decode", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mapped = {(m["piece"], m["pattern"]) for m in report["import"]["mapped"]}
    assert ("layers.1", "attention") in mapped and ("layers.0", "rotary_embedding") in mapped
    assert {n["op"] for n in report["import"]["native"]} == {"aten.add.Tensor"}
    assert report["counts"]["contract"] > 0 and report["architecture"] == "LlamaForCausalLM"

    assert main(["inspect", str(path), "--import", "--device", "cpu", "--phase", "decode"]) == 0
    text = capsys.readouterr().out
    assert "import of LlamaForCausalLM" in text and "native torch nodes (not views): 4" in text
    assert "== decode graph" in text


def test_inspect_import_names_a_directory_transformers_cannot_load(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    assert main(["inspect", str(tmp_path), "--import", "--device", "cpu"]) == 2
    assert "transformers could not load" in capsys.readouterr().err


def test_the_benchmark_runs_on_cpu_with_a_tiny_model(tmp_path):
    result = bench.run(bench.TINY_WORKLOAD, [1, 2], "cpu", "eager", save_model=str(tmp_path / "model"))
    rows = result["rows"]
    assert [(r["batch"], r["model"]) for r in rows] == [(1, "core"), (1, "imported"), (2, "core"), (2, "imported")]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    assert all(r["same_tokens"] for r in rows if r["model"] == "imported")
    table = bench.render(result)
    assert table.count("\n| 1 |") == 2 and "| batch | model | decode tok/s |" in table


def test_the_benchmark_reports_an_existing_checkpoints_shape(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    result = bench.run(bench.TINY_WORKLOAD, [1], "cpu", "eager", model_dir=str(path))
    from vllm_port.models import load_config

    config = load_config(path)
    assert result["workload"]["hidden_size"] == config.hidden_size
    assert result["workload"]["num_layers"] == config.num_layers
