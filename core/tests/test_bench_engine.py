"""``vllm-port bench engine`` on a tiny shape: the benchmark's own logic, in seconds, without vLLM."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open
from safetensors.torch import save_file

from vllm_port.bench import engine, engine_workload
from vllm_port.bench._decode import greedy
from vllm_port.bench.bench_command import ENGINE_SHAPES
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
#: Qwen3-30B-A3B's shape, tiny: hidden 64, 2 layers, 4 experts of 32, top 2, in float32 on the CPU.
TINY_MOE = replace(
    engine.QWEN3_30B_A3B_WORKLOAD,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=64,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    num_requests=3,
    prompt_len=5,
    output_len=4,
    dtype="float32",
    decode_batches=(),
)
#: The flags of TINY_MOE on the command line.
TINY_MOE_FLAGS = [
    "--shape", "qwen3-30b-a3b", "--hidden-size", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2",
    "--head-dim", "16", "--vocab-size", "256", "--num-experts", "4", "--experts-per-tok", "2",
    "--moe-intermediate-size", "32", "--num-requests", "3", "--prompt-len", "5", "--output-len", "4",
    "--dtype", "float32",
]  # fmt: skip
#: The flags of TINY on the command line.
TINY_FLAGS = [
    "--hidden-size", "64", "--intermediate-size", "192", "--layers", "2", "--heads", "4", "--kv-heads", "2",
    "--vocab-size", "256", "--num-requests", "3", "--prompt-len", "5", "--output-len", "4",
]  # fmt: skip


def _file_bytes_but_the_embedding(model_dir: Path) -> int:
    """Bytes of every tensor in a checkpoint's safetensors files but the embedding table."""
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name != "model.embed_tokens.weight":
                    t = f.get_slice(name)
                    total += math.prod(t.get_shape()) * {"F8_E4M3": 1, "F32": 4, "BF16": 2}[t.get_dtype()]
    return total


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
    assert engine_workload.step_weight_bytes(TINY) == total - embedding.numel() * embedding.element_size()


def test_engine_and_transformers_agree_and_report(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    args = [
        "bench", "engine", "--systems", "engine,transformers,transformers-compiled", "--json", str(out),
        "--hidden-size", "64", "--intermediate-size", "192", "--layers", "2", "--heads", "4", "--kv-heads", "2",
        "--vocab-size", "256", "--num-requests", "3", "--prompt-len", "5", "--output-len", "4",
    ]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["num_requests"] == 3 and result["engine_over_best_vllm"] is None
    # on CPU transformers runs the static cache uncompiled, and the result says so
    assert result["results"]["transformers-compiled"]["compiled"] is False
    assert "transformers-compiled: static cache, not compiled on CPU" in engine.render(result)
    for name in ("engine", "transformers", "transformers-compiled"):
        r = result["results"][name]
        assert r["output_tokens"] == 3 * 4
        assert r["output_tok_s"] > 0 and r["ttft_batch_s"] > 0 and r["elapsed_s"] > 0
    assert result["results"]["engine"]["platform"] == "cpu"
    rehearsal = result["results"]["engine"]["rehearsal_s"]  # the timed runs, once untimed before
    assert set(rehearsal) == {"one_token_run", "whole_run"} and min(rehearsal.values()) > 0
    # each system's numbers are on stderr as it finishes, so a run its caller cuts short still leaves them
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[bench engine")]
    assert [line.split("] ")[1].split(":")[0] for line in progress] == list(result["results"])
    assert all("output tok/s, all first tokens" in line for line in progress)


@pytest.mark.slow
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


def test_a_failing_transformers_peer_is_reported_and_the_engine_keeps_its_numbers(tmp_path, monkeypatch) -> None:
    def fails(*args, **kwargs):
        raise RuntimeError("compiler crashed")

    monkeypatch.setattr(engine, "run_transformers", fails)
    out = tmp_path / "r.json"
    assert main(["bench", "engine", "--systems", "engine,transformers-compiled", "--json", str(out), *TINY_FLAGS]) == 0
    result = json.loads(out.read_text())
    assert result["results"]["transformers-compiled"] == {"error": "RuntimeError: compiler crashed"}
    assert result["results"]["engine"]["output_tok_s"] > 0
    assert "| transformers-compiled | error: RuntimeError: compiler crashed |" in engine.render(result)


def test_the_shape_flag_names_the_presets_and_qwen3_30b_a3b_is_its_published_shape(tmp_path) -> None:
    from vllm_port.models import load_config

    assert list(ENGINE_SHAPES) == list(engine.SHAPES)
    assert engine.SHAPES["llama3-8b"].workload == engine.H200_WORKLOAD
    qwen = engine.SHAPES["qwen3-30b-a3b"]
    assert qwen.workload.num_layers == 8 and qwen.model_layers == 48
    config = engine_workload._hf_config(replace(qwen.workload, num_layers=qwen.model_layers))
    config.architectures, config.dtype = ["Qwen3MoeForCausalLM"], "bfloat16"
    (tmp_path / "config.json").write_text(config.to_json_string(use_diff=False))
    loaded = load_config(tmp_path)
    assert (loaded.moe.num_experts, loaded.moe.top_k, loaded.moe.intermediate_size) == (128, 8, 768)
    assert loaded.moe.renormalize and loaded.head_size == 128 and loaded.num_kv_heads == 4
    assert 30.0e9 < loaded.num_parameters < 31.0e9  # the published 30.5B


def test_expected_experts_under_uniform_routing() -> None:
    qwen = engine.QWEN3_30B_A3B_WORKLOAD
    assert engine_workload.expected_experts(qwen, 1) == pytest.approx(8)
    assert engine_workload.expected_experts(qwen, 64) == pytest.approx(128 * (1 - (120 / 128) ** 64))
    assert 125.9 < engine_workload.expected_experts(qwen, 64) < 126
    # the formula against counting: 2,000 draws of 8 distinct experts of 128 for each of 4 tokens
    g = torch.Generator().manual_seed(0)
    hits = [len({int(e) for _ in range(4) for e in torch.randperm(128, generator=g)[:8]}) for _ in range(2000)]
    assert sum(hits) / len(hits) == pytest.approx(engine_workload.expected_experts(qwen, 4), rel=0.01)


def test_moe_step_bytes_count_the_experts_read(tmp_path) -> None:
    model_dir = engine.build_model(tmp_path / "moe", TINY_MOE)
    every = engine_workload.step_weight_bytes(TINY_MOE)
    assert every == _file_bytes_but_the_embedding(model_dir)
    expert = 3 * 64 * 32 * 4
    assert every - engine_workload.step_weight_bytes(TINY_MOE, experts=2.5) == 2 * (4 - 2.5) * expert


@pytest.fixture
def fixed_copy_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows against a copy bandwidth of 100 GB/s instead of one measured (a second of CPU on 256 MiB)."""
    from vllm_port.bench import _timing

    monkeypatch.setattr(_timing, "copy_bandwidth_gbs", lambda device, nbytes: 100.0)


def test_moe_engine_and_transformers_run_end_to_end_and_report(tmp_path, fixed_copy_bandwidth) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "engine", "--systems", "engine,transformers", "--decode-batches", "1,2", "--json", str(out)]
    assert main([*args, *TINY_MOE_FLAGS]) == 0
    result = json.loads(out.read_text())
    w = result["workload"]
    assert (w["family"], w["shape"], w["num_experts"], w["num_layers"]) == ("qwen3_moe", "qwen3-30b-a3b", 4, 2)
    for name in ("engine", "transformers"):
        r = result["results"][name]
        assert r["output_tokens"] == 3 * 4
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("output_tok_s", "ttft_batch_s", "elapsed_s"))
    assert [(d["batch"], d["experts_read_per_layer"]) for d in result["decode"]] == [(1, 2.0), (2, 3.0)]
    for d in result["decode"]:
        assert math.isfinite(d["decode_tok_s"]) and d["decode_tok_s"] > 0 and d["step_bytes"] > 0
        assert "E*(1-(1-k/E)^B)" in d["routing"]
    text = engine.render(result)
    assert "2 of Qwen3-30B-A3B's 48 layers" in text and "4 experts of 32 (top 2, renormalised)" in text
    assert "the qwen3-30b-a3b preset's 256 cut" in text


def _dequantised_copy(fp8_dir: Path, path: Path) -> Path:
    """The fp8 checkpoint with each projection dequantised to float32 (what the fp8 weights mean), quantization_config gone."""
    from vllm_port.ops.fp8 import dequantize_fp8_weight

    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        weight = name.removesuffix("_scale")
        tensors[weight] = dequantize_fp8_weight(tensors[weight], tensors.pop(name).reshape(-1), torch.float32)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_fp8_checkpoint_generates_what_its_dequantised_weights_do(tmp_path) -> None:
    from vllm_port import LLM

    w = replace(TINY, weights="fp8")
    fp8_dir = engine.build_model(tmp_path / "fp8", w)
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.1.mlp.down_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.1.mlp.down_proj.weight_scale").get_shape() == [64, 1]
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"
    assert engine_workload.step_weight_bytes(w) == _file_bytes_but_the_embedding(fp8_dir)
    prompts = [{"prompt_token_ids": p} for p in engine.make_prompts(TINY, seed=5)]
    outputs = []
    for model_dir in (fp8_dir, _dequantised_copy(fp8_dir, tmp_path / "dequantised")):
        llm = LLM(str(model_dir), device="cpu", kv_cache_memory=4 << 20)
        try:
            if model_dir == fp8_dir:
                assert llm.runner.model.layers[0].qkv_weight.dtype == torch.float8_e4m3fn
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8))])
        finally:
            llm.close()
    assert outputs[0] == outputs[1] and len(set(outputs[0][0])) > 1


def test_bf16_and_fp8_run_side_by_side_with_their_ratio(tmp_path, capsys, fixed_copy_bandwidth) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "engine", "--weights", "fp32,fp8", "--systems", "engine", "--decode-batches", "1", "--json"]
    assert main([*args, str(out), *TINY_FLAGS, "--save-model", str(tmp_path / "m")]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == ["fp32", "fp8"] and list(result["results"]) == ["engine", "engine (fp8)"]
    assert [(d["weights"], d["copy_gbs"]) for d in result["decode"]] == [("fp32", 100.0), ("fp8", 100.0)]
    (ratio,) = result["fp8_over_float_decode"]
    assert ratio["batch"] == 1 and ratio["ratio"] == pytest.approx(ratio["fp8_tok_s"] / ratio["float_tok_s"])
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m-fp8" / "config.json").is_file()
    text = capsys.readouterr().out
    assert "fp8 / fp32 decode tok/s at batch 1:" in text and "transformers is not needed" in text


def test_an_fp8_kv_cache_runs_and_its_decode_rows_count_one_byte_an_element(tmp_path, capsys, fixed_copy_bandwidth):
    out = tmp_path / "r.json"
    args = ["bench", "engine", "--kv-cache-dtype", "fp8", "--systems", "engine", "--decode-batches", "2", "--json"]
    assert main([*args, str(out), *TINY_FLAGS, "--dtype", "float32"]) == 0
    result = json.loads(out.read_text())
    assert result["kv_cache_dtype"] == "fp8" and result["results"]["engine"]["output_tokens"] == 3 * 4
    (row,) = result["decode"]
    w = replace(TINY, dtype="float32")
    kv_fp8 = 2 * w.num_layers * w.num_kv_heads * w.head_size  # one byte an element; float32 would be four
    assert engine_workload.kv_token_bytes(w, "fp8") == kv_fp8 == engine_workload.kv_token_bytes(w) // 4
    mean_context = w.prompt_len + w.output_len / 2
    assert row["step_bytes"] == pytest.approx(engine_workload.step_weight_bytes(w) + 2 * mean_context * kv_fp8)
    assert "KV cache fp8" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--h200", "--shape", "qwen3-30b-a3b"], "--h200 is --shape llama3-8b"),
        (["--num-experts", "4"], "--num-experts is for a mixture-of-experts shape"),
        (["--shape", "qwen3-30b-a3b", "--experts-per-tok", "200"], "--experts-per-tok 200 is more than the 128"),
        (["--weights", "int4"], "--weights 'int4'"),
        (["--weights", "bf16,fp16"], "at most one float checkpoint"),
        (["--weights", "bf16,fp8", "--dtype", "float32"], "--weights bf16 and --dtype float32 disagree"),
        (["--shape", "qwen3-30b-a3b", "--weights", "bf16,fp8"], "--weights fp8 needs a dense shape"),
        (["--weights", "fp8", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2"),
        (["--weights", "bf16,fp8", "--model", "/nowhere"], "--model is one checkpoint"),
        (["--weights", "fp8", "--systems", "engine,transformers"], "transformers and vLLM run a float checkpoint"),
        (["--systems", "engine,vlm"], "--systems 'engine,vlm'"),
        (["--layers", "0"], "--layers must be positive"),
        (["--decode-batches", "1,x"], "--decode-batches must be comma-separated positive integers"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(flags, says, capsys) -> None:
    assert main(["bench", "engine", *flags]) == 2
    assert says in capsys.readouterr().err


def test_a_saved_model_of_another_shape_is_refused_naming_the_flag(tmp_path, capsys) -> None:
    engine.build_model(tmp_path / "m", TINY)
    args = ["bench", "engine", "--systems", "engine", *TINY_FLAGS, "--layers", "1", "--save-model", str(tmp_path / "m")]
    assert main(args) == 2
    assert "--save-model" in capsys.readouterr().err
