"""A model's ``generation_config.json`` gives the sampling defaults of requests that leave them out, as in vLLM.

vLLM (``--generation-config auto``, its default) applies an instruct model's ``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens``; a request's own fields win. The
oracle is this engine with the same fields given explicitly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_port import LLM, SamplingParams
from vllm_port.data import bundled_model_dir
from vllm_port.errors import ModelLoadError

PROMPT = "It is a truth universally acknowledged"


def _model_with(tmp_path: Path, **fields: object) -> Path:
    model = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, **fields}))
    return model


def test_the_models_defaults_apply_to_what_a_request_leaves_out(cpu_runtime, tmp_path: Path) -> None:
    model = _model_with(tmp_path, do_sample=True, temperature=0.7, top_k=1, top_p=0.9, max_new_tokens=5)
    # no prefix cache: a run that reuses the greedy run's prompt blocks computes its logits by another path,
    # and a near-tie may then break the other way (seen once in the full suite); here both compute alike
    llm = LLM(str(model), device=cpu_runtime, kv_cache_memory=2 << 20, enable_prefix_caching=False)
    assert llm.sampling_defaults == {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "max_tokens": 5}
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.7, 1, 0.9, 5)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    for seed in (1, 2):  # top_k=1 from the file: every seed draws the greedy tokens, 5 of them
        got = llm.generate(PROMPT, None)[0].outputs[0]
        assert got.token_ids == greedy.token_ids, seed
    own = llm.generate(PROMPT, SamplingParams(max_tokens=7, seed=3))[0].outputs[0]  # a request's own params win
    assert len(own.token_ids) == 7
    plain = LLM(str(model), device=cpu_runtime, kv_cache_memory=2 << 20, generation_config="vllm")
    assert (
        plain.sampling_defaults == {} and plain.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    )


def test_a_bad_default_is_refused_naming_the_file_and_field(cpu_runtime, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"generation_config.json: field 'temperature' is 'hot'"):
        LLM(str(_model_with(tmp_path / "a", temperature="hot")), device=cpu_runtime, kv_cache_memory=2 << 20)
    with pytest.raises(ModelLoadError, match=r"generation_config.json: a sampling default is out of range.*top_p"):
        LLM(str(_model_with(tmp_path / "b", top_p=1.5)), device=cpu_runtime, kv_cache_memory=2 << 20)
    with pytest.raises(ValueError, match=r"generation_config is 'nowhere'; it must be 'auto'"):
        LLM(device=cpu_runtime, generation_config="nowhere")
