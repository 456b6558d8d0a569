"""``vllm-port inspect MODEL_DIR --import`` and the importer benchmark, on tiny models (CPU)."""

from __future__ import annotations

import json

import pytest
from tiny_models import save_tiny_model

from vllm_port.bench import importer as bench
from vllm_port.cli import main


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_benchmark_runs_on_cpu_with_a_tiny_model(tmp_path):
    result = bench.run(bench.TINY_WORKLOAD, [1, 2], "cpu", "eager", save_model=str(tmp_path / "model"))
    rows = result["rows"]
    assert [(r["batch"], r["model"]) for r in rows] == [(1, "core"), (1, "imported"), (2, "core"), (2, "imported")]
    assert all(r["decode_tok_s"] > 0 and len(r["decode_s_runs"]) == 2 for r in rows)  # the fastest of 2 runs
    output_len = bench.TINY_WORKLOAD.output_len
    for r in rows:  # every sequence compared (batches under COMPARED_SEQUENCES), whole token lists kept
        assert len(r["tokens"]) == r["batch"] and all(len(t) == output_len for t in r["tokens"])
    # float32 on CPU: the imported model's greedy tokens are the core model's, every one
    imported = [r for r in rows if r["model"] == "imported"]
    assert [r["agreeing_tokens"] for r in imported] == [[output_len], [output_len] * 2]
    assert all(r["min_agreeing_tokens"] == output_len for r in imported)
    table = bench.render(result)
    assert table.count("\n| 1 |") == 2 and "| batch | model | decode tok/s |" in table
    assert f"| {output_len} of {output_len} |" in table and "fastest of 2 timed runs" in table


def test_the_benchmark_counts_the_leading_tokens_two_runs_agree_on():
    assert bench.leading_agreement([5, 6, 7, 8], [5, 6, 9, 8]) == 2  # a later re-agreement does not count
    assert bench.leading_agreement([1, 2], [1, 2]) == 2
    assert bench.leading_agreement([3], [4]) == 0
    assert bench.leading_agreement([], []) == 0


@pytest.mark.slow
def test_the_benchmark_warms_each_model_up_with_every_prompt_of_the_batch(tmp_path, monkeypatch):
    calls = []
    real = bench.warm_up
    monkeypatch.setattr(
        bench, "warm_up", lambda llm, prompts, **kw: calls.append((len(prompts), kw)) or real(llm, prompts, **kw)
    )
    bench.run(bench.TINY_WORKLOAD, [3], "cpu", "eager", save_model=str(tmp_path / "model"), repeats=1)
    assert calls == [(3, {"num_prompts": 3, "max_tokens": bench.WARM_UP_TOKENS})] * 2  # core, then imported


@pytest.mark.slow
def test_the_benchmark_reports_an_existing_checkpoints_shape(tmp_path):
    path = save_tiny_model("llama", tmp_path / "llama")
    result = bench.run(bench.TINY_WORKLOAD, [1], "cpu", "eager", model_dir=str(path))
    from vllm_port.models import load_config

    config = load_config(path)
    assert result["workload"]["hidden_size"] == config.hidden_size
    assert result["workload"]["num_layers"] == config.num_layers
