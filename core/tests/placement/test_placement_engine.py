"""A placed model in the engine (greedy output as unplaced), in ``vllm-port inspect --placement``, and in the bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_port import LLM, SamplingParams
from vllm_port.placement import PlacementError

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [12, 13, 14],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57],
]
POLICY = """
[[rules]]
label = "layer 1 on cpu-b"
platform = "cpu-b"
layers = "1"

[[rules]]
platform = "cpu-b"
part = ["mlp", "lm_head"]
"""


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_engine_greedy_output_equals_unplaced(llama_dir: Path, platforms, tmp_path: Path) -> None:
    (tmp_path / "policy.toml").write_text(POLICY)
    common = dict(kv_cache_memory=1 << 20, max_num_seqs=4, max_num_batched_tokens=16, seed=0)  # chunked prefill too
    with LLM(str(llama_dir), device="cpu", **common) as plain:
        want = _greedy(plain)
    with LLM(str(llama_dir), placement=str(tmp_path / "policy.toml"), devices=["cpu", "cpu-b"], **common) as placed:
        assert placed.platform == "cpu" and placed.captured_batch_sizes == []
        assert placed.runner.kv.platforms_by_layer == ["cpu", "cpu-b"]
        assert placed.runner.kv.blocks is None  # split caches: no swap space
        assert _greedy(placed) == want
        stats = placed.placement.model.stats.to_json()
        assert stats["cpu->cpu-b"]["count"] > 0 and stats["cpu-b->cpu"]["count"] > 0


def test_engine_platforms_from_the_policy_and_swap(llama_dir: Path, platforms) -> None:
    policy = {"rules": [{"platform": "cpu-b", "part": "attention", "layers": "0"}]}
    with LLM(str(llama_dir), device="cpu", placement=policy, kv_cache_memory=1 << 20, max_num_seqs=2) as llm:
        assert list(llm.placement.platforms) == ["cpu", "cpu-b"]  # --device first, then what the policy names
    with pytest.raises(PlacementError, match=r"swap_space=4,096: .* keeps KV caches on cpu, cpu-b; set swap_space=0"):
        LLM(str(llama_dir), device="cpu", placement=policy, swap_space=4096, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="tensor_parallel_size=1 with placement"):
        LLM(str(llama_dir), placement=policy, tensor_parallel_size=2)


def test_inspect_placement(llama_dir: Path, platforms, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_port.cli import main

    (tmp_path / "policy.toml").write_text(POLICY)
    args = ["inspect", str(llama_dir), "--placement", str(tmp_path / "policy.toml"), "--devices", "cpu,cpu-b"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    decode = report["phases"]["decode"]
    where = {n["name"]: n["platform"] for n in decode["nodes"]}
    assert where["paged_attention_1"] == "cpu-b" and where["paged_attention"] == "cpu" and where["lm_head"] == "cpu-b"
    assert report["kv_cache_platforms"] == ["cpu", "cpu-b"]
    crossing = {(t["src"], t["dst"]) for t in decode["transfers"]}
    assert crossing == {("cpu", "cpu-b"), ("cpu-b", "cpu")}
    assert decode["totals"]["cpu->cpu-b"]["count"] == sum(1 for t in decode["transfers"] if t["dst"] == "cpu-b")
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "what crosses between platforms" in text and "rule 0 (layer 1 on cpu-b)" in text
    assert "bytes per token" in text and "kv caches: cpu: layers 0; cpu-b: layers 1" in text
    (tmp_path / "bad.toml").write_text('[[rules]]\nplatform = "tpu"\n')
    assert main(["inspect", str(llama_dir), "--placement", str(tmp_path / "bad.toml"), "--devices", "cpu,cpu-b"]) == 2
    assert "placement rule 0 of" in capsys.readouterr().err


def test_bench_placement_runs_tiny(platforms, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from vllm_port.bench import placement

    result = placement.run(
        None, "tiny", device="cpu-b", host="cpu", place="mlp,lm_head", batches=(2,), prompt_len=6, output_len=3
    )
    assert [r["config"] for r in result["rows"]] == ["host", "placed", "device"]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
    w = result["workload"]
    rope_table = w["max_position_embeddings"] * (w["hidden_size"] // w["num_heads"]) * 4  # float32 cos/sin
    assert result["rows"][1]["device_weight_bytes"] == result["weights_bytes"] - result["moved_bytes"] + rope_table
    table = placement.render(result)
    assert "| mlp,lm_head on cpu, rest on cpu-b | 2 |" in table
    with pytest.raises(ValueError, match="--place 'ffn'"):
        placement.policy_for("ffn", "cpu")
