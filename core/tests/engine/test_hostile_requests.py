"""Hostile requests and engine arguments (issue 25), on the bundled model.

- every ``SamplingParams`` field is held to the range the step's tensors carry (int64 ids, seeds
  and ``top_k``; float32 temperatures and ``top_p``) when it is made, not inside ``generate``;
- text that is not valid Unicode and ``bytes`` prompts get per-request errors (the batch runs on),
  and bytes are never taken as token ids;
- ``LLM(...)`` arguments are refused by their own names, before anything is loaded;
- sizing: on a host platform the default KV budget is bounded (``HOST_KV_CACHE_BYTES``) and sized
  by what the requests can use; the rotary table is built for ``max_model_len``, not the config's
  maximum, and positions past it are refused.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from vllm_port import LLM, SamplingParams
from vllm_port.data import bundled_model_dir
from vllm_port.engine import llm as llm_module
from vllm_port.engine.scheduler import StepBatch

GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture(scope="module")
def bundled(cpu_runtime) -> LLM:
    """The bundled model on the CPU platform, with a small cache."""
    with LLM(device=cpu_runtime, kv_cache_memory=8 << 20) as llm:
        yield llm


def _with_config(tmp_path: Path, **fields) -> Path:
    model = Path(shutil.copytree(bundled_model_dir(), tmp_path / "model"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **fields}))
    return model


# --- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("top_k", 2**70, r"top_k is 1180591620717411303424; it must be an int in \[-1, 2\*\*63 - 1\]"),
        ("top_k", 2**63, r"top_k is 9223372036854775808"),
        ("max_tokens", 2**64, r"max_tokens is 18446744073709551616; it must be an int in \[1, 2\*\*63 - 1\]"),
        ("seed", 2**63, r"seed is 9223372036854775808; it must be None or an int in \[0, 2\*\*63 - 1\]"),
        ("stop_token_ids", [2**63], r"stop_token_ids is \[9223372036854775808\]; it must be a list of ids in"),
        ("temperature", float("nan"), r"temperature is nan; it must be 0 \(greedy\) or a number in \[1e-05, 3.4e38\]"),
        ("temperature", float("inf"), r"temperature is inf"),
        ("temperature", 1e39, r"temperature is 1e\+39"),  # finite in Python, infinite in float32
        ("temperature", 1e-40, r"temperature is 1e-40"),  # float32 logits / 1e-40 overflow
        ("temperature", True, r"temperature is True"),
        ("top_p", float("nan"), r"top_p is nan; it must be in \(0, 1\]"),
        ("top_p", 1e-50, r"top_p is 1e-50; it must be in \(0, 1\] and above 0 in float32"),
        ("stop", "\ud800", r"stop is '\\ud800'; it must be a non-empty string of valid Unicode"),
        ("stop", 7, r"stop is 7"),
    ],
)
def test_a_field_outside_what_the_kernels_take_is_refused_when_made(field, value, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
        SamplingParams(**{field: value})


def test_the_largest_values_the_kernels_take_run(bundled):
    params = SamplingParams(temperature=1e-5, top_k=2**63 - 1, top_p=1e-30, seed=2**63 - 1, max_tokens=3)
    out = bundled.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_a_field_changed_after_construction_is_refused_by_generate(bundled):
    params = SamplingParams(temperature=0)
    params.top_k = 2**70
    with pytest.raises(ValueError, match=r"SamplingParams\.top_k is 1180591620717411303424"):
        bundled.generate([[5, 6, 7]], params)


# --- prompts --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_lone_surrogate_gets_a_per_request_error_and_the_batch_runs(bundled):
    outs = bundled.generate(["\ud800abc", "The sea", "ok\udfff"], GREEDY)
    first, second, third = (o.outputs[0] for o in outs)
    assert first.finish_reason == "error"
    assert first.error == (
        "request 0: the prompt is not valid Unicode: a lone surrogate '\\ud800' at character 0; fix the text where "
        "it was decoded (errors='replace' drops such characters) or pass token ids"
    )
    assert third.finish_reason == "error" and third.error.startswith("request 2: the prompt is not valid Unicode")
    assert "at character 2" in third.error
    assert second.finish_reason == "length" and len(second.token_ids) == 4


@pytest.mark.parametrize("prompt", [b"abc", bytearray(b"abc"), memoryview(b"abc")], ids=["bytes", "bytearray", "view"])
def test_a_binary_prompt_is_never_taken_as_token_ids(bundled, prompt):
    outs = bundled.generate([prompt, [5, 6, 7]], GREEDY)
    error = outs[0].outputs[0]
    assert error.finish_reason == "error" and error.token_ids == [] and outs[0].prompt_token_ids == []
    assert error.error == (
        f"request 0: the prompt is {type(prompt).__name__} (b'abc'), which is never taken as token ids; decode it "
        "to text (prompt.decode('utf-8')) or pass a list of int token ids"
    )
    assert outs[1].outputs[0].finish_reason == "length"


def test_a_bare_bytes_prompt_is_one_refused_request(bundled):
    """``generate(b"abc")`` is one prompt (as ``generate("abc")``), not three token ids 97, 98, 99."""
    outs = bundled.generate(b"abc", GREEDY)
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "error"
    assert outs[0].outputs[0].error.startswith("request 0: the prompt is bytes")


def test_streaming_reports_the_same_per_request_errors(bundled):
    deltas = list(bundled.stream(["\ud800", b"x", [5, 6]], GREEDY))
    errors = {d.index: d.error for d in deltas if d.finish_reason == "error"}
    assert sorted(errors) == [0, 1]
    assert "not valid Unicode" in errors[0] and "never taken as token ids" in errors[1]


# --- engine arguments -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argument, value, expected",
    [
        ("max_num_seqs", 0, "an int >= 1 (the most requests running at once)"),
        ("max_num_seqs", 2.0, "an int >= 1"),
        ("max_num_batched_tokens", 0, "an int >= 1 (tokens one step may run)"),
        ("max_model_len", 1, "None or an int >= 2"),
        ("max_model_len", True, "None or an int >= 2"),
        ("tensor_parallel_size", 0, "an int >= 1"),
        ("kv_cache_memory", 0, "None (the platform's default), a fraction in (0, 1]"),
        ("kv_cache_memory", 1.5, "None (the platform's default), a fraction in (0, 1]"),
        ("kv_cache_memory", True, "None (the platform's default)"),
        ("swap_space", -1, "None or an int of bytes >= 0"),
        ("seed", "7", "None or an int"),
        ("plugins", ["cpu"], "None or an allow/deny list"),
        ("enable_prefix_caching", "yes", "True or False"),
        ("enforce_eager", 1, "True or False"),
    ],
)
def test_an_engine_argument_is_refused_by_its_own_name(cpu_runtime, argument, value, expected):
    with pytest.raises(ValueError) as refused:
        LLM(device=cpu_runtime, **{argument: value})
    assert str(refused.value).startswith(f"LLM({argument}={value!r}): {argument} is {value!r}; it must be {expected}")
    assert "KV-cache budget" not in str(refused.value)


# --- sizing ---------------------------------------------------------------------------------------


def test_the_default_host_budget_is_capped_and_documented():
    assert llm_module.HOST_KV_CACHE_BYTES == 4 << 30
    doc = llm_module.LLM.__doc__
    assert "HOST_KV_CACHE_BYTES" in doc and "4 GiB" in doc
    docs = (Path(__file__).resolve().parents[3] / "docs" / "engine.md").read_text()
    assert "4 GiB" in docs and "kv_cache_memory" in docs


def test_a_long_context_config_does_not_reserve_its_full_context_by_default(tmp_path, cpu_runtime, monkeypatch):
    """max_position_embeddings 131072 x 256 sequences would be 64 GiB of cache for the bundled model: the default
    takes HOST_KV_CACHE_BYTES (shrunk here to 32 MiB so the test allocates little) and sizes max_model_len by it."""
    monkeypatch.setattr(llm_module, "HOST_KV_CACHE_BYTES", 32 << 20)
    model = _with_config(tmp_path, max_position_embeddings=131072)
    with LLM(model, device=cpu_runtime) as llm:
        assert llm.runner.kv.budget_bytes <= 32 << 20
        token_bytes = llm.runner.layout.block_bytes // llm.runner.block_size
        assert llm.max_model_len == (32 << 20) // token_bytes == 16384
        assert llm.runner.model.cos_sin_cache.shape[0] == 16384
        out = llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0]
        assert out.finish_reason == "length"


def test_kv_cache_memory_overrides_the_host_default(tmp_path, cpu_runtime):
    model = _with_config(tmp_path, max_position_embeddings=131072)
    with LLM(model, device=cpu_runtime, kv_cache_memory=4 << 20, max_num_seqs=2) as llm:
        assert llm.runner.kv.budget_bytes <= 4 << 20
        assert llm.max_model_len == 2048  # 4 MiB of 2 KiB tokens


def test_a_ten_million_position_config_builds_a_table_for_what_the_cache_holds(tmp_path, cpu_runtime, monkeypatch):
    """max_position_embeddings 10^7 once drove a process past 4 GiB building its rope table."""
    monkeypatch.setattr(llm_module, "HOST_KV_CACHE_BYTES", 16 << 20)
    model = _with_config(tmp_path, max_position_embeddings=10**7)
    started = time.perf_counter()
    with LLM(model, device=cpu_runtime) as llm:
        assert llm.runner.model.cos_sin_cache.shape == (8192, 64)
        assert llm.max_model_len == 8192
    assert time.perf_counter() - started < 60


@pytest.mark.slow
def test_the_rope_table_covers_max_model_len_and_no_more(cpu_runtime):
    with LLM(device=cpu_runtime, max_model_len=64, kv_cache_memory=8 << 20) as llm:
        assert llm.runner.model.cos_sin_cache.shape == (64, 64)
        assert llm.runner.model.max_positions == 64
        long = llm.generate([list(range(5, 69))], GREEDY)[0].outputs[0]
        assert long.finish_reason == "error" and "max_model_len is 64" in long.error
        out = llm.generate([list(range(5, 55))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 14


def test_a_position_past_the_rope_table_is_refused_by_the_runner(cpu_runtime):
    with LLM(device=cpu_runtime, max_model_len=64, kv_cache_memory=8 << 20) as llm:
        batch = StepBatch(
            input_ids=[5],
            positions=[64],
            slot_mapping=[64],
            block_tables=[[0, 1, 2, 3, 4]],
            seq_lens=[65],
            query_lens=[1],
            sample_rows=[0],
            temperatures=[0.0],
            top_ps=[1.0],
            top_ks=[0],
            seeds=[0],
        )
        with pytest.raises(ValueError, match=r"position 64, but the model's rotary table covers positions \[0, 64\)"):
            llm.runner.execute(batch)


def test_the_table_is_the_configs_when_no_max_is_given():
    from vllm_port.models import load_config, rope_cos_sin_cache

    config = load_config(bundled_model_dir())
    assert rope_cos_sin_cache(config, torch.device("cpu")).shape[0] == config.max_position_embeddings
    assert rope_cos_sin_cache(config, torch.device("cpu"), 10**9).shape[0] == config.max_position_embeddings
    with pytest.raises(ValueError, match="max_positions is 0; it must be an int >= 1"):
        rope_cos_sin_cache(config, torch.device("cpu"), 0)


def test_the_table_built_in_chunks_equals_the_one_shot_table():
    """The table is built a chunk of positions at a time (peak memory: the table); the values are the same bits."""
    import dataclasses

    from vllm_port.models import load_config, rope_cos_sin_cache, rope_inverse_frequencies
    from vllm_port.models.llama import _ROPE_CHUNK

    config = dataclasses.replace(load_config(bundled_model_dir()), max_position_embeddings=2 * _ROPE_CHUNK + 5)
    angles = torch.arange(config.max_position_embeddings, dtype=torch.float64)[:, None] * rope_inverse_frequencies(
        config
    )
    one_shot = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)
    assert torch.equal(rope_cos_sin_cache(config, torch.device("cpu")), one_shot)
