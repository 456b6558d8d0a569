"""A placed model in the engine (greedy output as unplaced), in ``vllm-port inspect --placement``, and in the bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.multiprocessing.reductions import StorageWeakRef

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


@pytest.mark.parametrize(
    "policy",
    [
        {"rules": []},
        {"rules": [{"platform": "cpu-b", "part": "mlp"}]},
        {"rules": [{"platform": "cpu-b", "layers": "1"}]},
    ],
    ids=["nothing-placed", "mlp-placed", "a-layer-placed"],
)
def test_close_gives_a_placed_engines_caches_back_while_it_is_still_referenced(llama_dir: Path, platforms, policy):
    """Where one platform holds every layer's cache, the placed cache keeps that platform's view of the whole buffer
    (for swapping): ``close()`` drops it too, so the buffer goes at once (``bench placement`` builds its next engine
    while the last one is still bound)."""
    llm = LLM(str(llama_dir), placement=policy, devices=["cpu", "cpu-b"], kv_cache_memory=1 << 20, max_num_seqs=2)
    _greedy(llm)
    buffers = [StorageWeakRef(c.buffer.untyped_storage()) for c in llm.runner.kv.caches.values()]
    llm.close()
    assert buffers and all(b.expired() for b in buffers)


@pytest.mark.slow
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


@pytest.mark.slow
def test_placed_engine_on_an_fp8_cache_equals_unplaced(llama_dir: Path, platforms, tmp_path: Path) -> None:
    """The placed graphs are traced for the e4m3 cache: its ``*_fp8`` ops sit with their layer's cache."""
    (tmp_path / "policy.toml").write_text(POLICY)
    common = dict(kv_cache_memory=1 << 20, max_num_seqs=4, seed=0, kv_cache_dtype="fp8")
    with LLM(str(llama_dir), device="cpu", **common) as plain:
        want = _greedy(plain)
    with LLM(str(llama_dir), placement=str(tmp_path / "policy.toml"), devices=["cpu", "cpu-b"], **common) as placed:
        assert placed.runner.kv.platforms_by_layer == ["cpu", "cpu-b"]
        assert _greedy(placed) == want


@pytest.mark.slow
def test_engine_pipeline_greedy_output_equals_unplaced(llama_dir: Path, platforms) -> None:
    """Layer 1 and the head on cpu-b's second device, the KV cache of layer 1 there too: the same tokens."""
    policy = {"rules": [{"platform": "cpu-b:1", "layers": "1"}, {"platform": "cpu-b:1", "part": "lm_head"}]}
    common = dict(kv_cache_memory=1 << 20, max_num_seqs=4, max_num_batched_tokens=16, seed=0)
    with LLM(str(llama_dir), device="cpu-b", **common) as plain:
        want = _greedy(plain)
    with LLM(str(llama_dir), placement=policy, devices=["cpu-b"], **common) as placed:
        assert placed.runner.kv.platforms_by_layer == ["cpu-b", "cpu-b:1"]
        assert _greedy(placed) == want
        assert set(placed.placement.model.stats.to_json()) == {"cpu-b->cpu-b:1", "cpu-b:1->cpu-b"}


def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices (the lead's GPU runs)")
def test_engine_pipeline_over_two_gpus(llama_dir: Path) -> None:
    """On two GPUs: layer 1, its KV cache and the head on cuda:1, Triton's kernels launched there; the same tokens
    as the same placed model on cuda:0 alone (the same kernels and passes)."""
    import torch

    policy = {"rules": [{"platform": "cuda:1", "layers": "1"}, {"platform": "cuda:1", "part": "lm_head"}]}
    common = dict(kv_cache_memory=1 << 24, max_num_seqs=4, max_num_batched_tokens=16, seed=0)
    with LLM(str(llama_dir), placement={"rules": []}, devices=["cuda"], **common) as one:
        want = _greedy(one)
    with LLM(str(llama_dir), placement=policy, devices=["cuda"], **common) as two:
        assert [c.device for c in two.runner.kv.key_caches] == [torch.device("cuda", 0), torch.device("cuda", 1)]
        assert _greedy(two) == want
        assert set(two.placement.model.stats.to_json()) == {"cuda->cuda:1", "cuda:1->cuda"}


@pytest.mark.slow
def test_engine_platforms_from_the_policy_and_swap(llama_dir: Path, platforms) -> None:
    policy = {"rules": [{"platform": "cpu-b", "part": "attention", "layers": "0"}]}
    with LLM(str(llama_dir), device="cpu", placement=policy, kv_cache_memory=1 << 20, max_num_seqs=2) as llm:
        assert list(llm.placement.platforms) == ["cpu", "cpu-b"]  # --device first, then what the policy names
    with pytest.raises(PlacementError, match=r"swap_space=4,096: .* keeps KV caches on cpu, cpu-b; set swap_space=0"):
        LLM(str(llama_dir), device="cpu", placement=policy, swap_space=4096, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="tensor_parallel_size=1 and pipeline_parallel_size=1 with placement"):
        LLM(str(llama_dir), placement=policy, tensor_parallel_size=2)


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_placement_runs_tiny(cpu_jit: float, capsys: pytest.CaptureFixture[str]) -> None:
    """The bench on two CPU platforms; a platform that compiles per batch size is measured past its compiles."""
    pytest.importorskip("transformers")
    from vllm_port.bench import placement

    JIT_SECONDS = cpu_jit  # noqa: N806 (the conftest constant's name)
    output_len = 3
    result = placement.run(
        None,
        "tiny",
        device="cpu-jit",
        host="cpu",
        place="mlp,lm_head",
        batches=(2,),
        prompt_len=6,
        output_len=output_len,
        repeats=1,
    )
    assert [r["config"] for r in result["rows"]] == ["host", "placed", "device"]
    assert all(r["decode_tok_s"] > 0 for r in result["rows"])
    # 128-token blocks (the engine's on cpu-jit, as on CUDA) for sequences of 9 tokens: every sequence of the
    # batch decodes in each step (the H200 run's KV cache held 3 sequences of 8: its batch-8 steps tripled)
    assert [r["decode_seqs"] for r in result["rows"]] == [2, 2, 2]
    # the placed model meets batch size 2 first: its decode attention compiles in the first run, which is
    # reported apart, and the steady rate leaves it out (H200: Triton's compiles had tripled a step)
    placed_row = result["rows"][1]
    jit_per_step_ms = JIT_SECONDS * 1e3 / (output_len - 1)
    assert placed_row["cold_step_ms"] >= 0.7 * jit_per_step_ms
    assert placed_row["step_ms"] < 0.4 * jit_per_step_ms
    w = result["workload"]
    # float32 cos/sin for the engine's max_model_len (the prompt and the output), not the config's maximum
    rope_table = (6 + output_len) * (w["hidden_size"] // w["num_heads"]) * 4
    assert placed_row["device_weight_bytes"] == result["weights_bytes"] - result["moved_bytes"] + rope_table
    table = placement.render(result)
    assert "| mlp,lm_head on cpu, rest on cpu-jit | 2 |" in table and "first run step ms" in table
    with pytest.raises(ValueError, match="--place 'ffn'"):
        placement.policy_for("ffn", "cpu")
