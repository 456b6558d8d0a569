"""``vllm-port bench engine`` on a tiny shape: the benchmark's own logic, in seconds, without vLLM."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from vllm_port.bench import engine
from vllm_port.cli import main

TINY = replace(
    engine.CPU_WORKLOAD,
    hidden_size=64,
    intermediate_size=192,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
    num_requests=3,
    prompt_len=5,
    output_len=4,
)


def test_prompts_are_reproducible_and_avoid_special_ids() -> None:
    a, b = engine.make_prompts(TINY, seed=3), engine.make_prompts(TINY, seed=3)
    assert a == b and len(a) == 3 and all(len(p) == 5 for p in a)
    assert all(3 <= t < TINY.vocab_size for p in a for t in p)


def test_weight_bytes_count_every_matrix_but_the_embedding(tmp_path) -> None:
    from transformers import LlamaForCausalLM

    model_dir = engine.build_model(tmp_path / "m", TINY)
    hf = LlamaForCausalLM.from_pretrained(model_dir)
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    embedding = hf.model.embed_tokens.weight
    assert engine._weight_bytes(TINY) == total - embedding.numel() * embedding.element_size()


def test_engine_and_transformers_agree_and_report(tmp_path) -> None:
    out = tmp_path / "r.json"
    args = [
        "bench", "engine", "--systems", "engine,transformers", "--json", str(out),
        "--hidden-size", "64", "--intermediate-size", "192", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--vocab-size", "256", "--num-requests", "3", "--prompt-len", "5", "--output-len", "4",
    ]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["num_requests"] == 3 and result["engine_over_best_vllm"] is None
    for name in ("engine", "transformers"):
        r = result["results"][name]
        assert r["output_tokens"] == 3 * 4
        assert r["output_tok_s"] > 0 and r["ttft_batch_s"] > 0 and r["elapsed_s"] > 0
    assert result["results"]["engine"]["platform"] == "cpu"


def test_decode_rates_carry_bandwidth_utilisation(tmp_path) -> None:
    w = replace(TINY, decode_batches=(1, 2))
    rows = engine._decode_rates(engine.build_model(tmp_path / "m", w), w, "cpu", "eager")
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["copy_gbs"] > 0
        assert r["bandwidth_utilisation"] == pytest.approx(r["achieved_gbs"] / r["copy_gbs"])


def test_a_failing_vllm_peer_is_reported_not_raised(tmp_path) -> None:
    prompts = tmp_path / "p.json"
    prompts.write_text("[[5, 6]]")
    r = engine.run_vllm("/bin/false", tmp_path, prompts, TINY, reserve_none=True)
    assert "error" in r and "exited 1" in r["error"]
