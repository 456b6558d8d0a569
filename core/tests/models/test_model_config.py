"""``load_config``: the config.json of each family, both transformers spellings, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_port.errors import ModelLoadError
from vllm_port.models import load_config

# The published Llama-3.1-8B config.json (transformers 4.x spelling), as a test of real-world fields.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def _write(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_tiny_families(tiny_model_dirs):
    llama, qwen2, mistral = (load_config(tiny_model_dirs[f]) for f in ("llama", "qwen2", "mistral"))
    assert (llama.architecture, llama.head_size, llama.num_heads, llama.num_kv_heads) == ("LlamaForCausalLM", 64, 4, 1)
    assert llama.rope_scaling["rope_type"] == "llama3" and llama.rope_scaling["factor"] == 8.0
    assert (llama.bos_token_id, llama.eos_token_ids, llama.dtype) == (1, (2, 3), torch.float32)
    assert not llama.tie_word_embeddings and not llama.attention_bias and llama.sliding_window == 0
    assert (qwen2.architecture, qwen2.head_size, qwen2.rope_theta) == ("Qwen2ForCausalLM", 64, 1e6)
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings and qwen2.sliding_window == 0
    assert (qwen2.bos_token_id, qwen2.eos_token_ids, qwen2.rope_scaling) == (None, (4,), None)
    assert (mistral.architecture, mistral.head_size, mistral.sliding_window) == ("MistralForCausalLM", 128, 8)


def test_transformers_4_spelling_of_llama_31_8b(tmp_path):
    config = load_config(_write(tmp_path, LLAMA_31_8B, {"eos_token_id": [128001, 128008, 128009]}))
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads) == (4096, 32, 32, 8)
    assert (config.head_size, config.intermediate_size, config.vocab_size) == (128, 14336, 128256)
    assert (config.rope_theta, config.rope_scaling["original_max_position_embeddings"]) == (500000.0, 8192)
    assert (config.dtype, config.rms_norm_eps, config.max_position_embeddings) == (torch.bfloat16, 1e-5, 131072)
    assert config.eos_token_ids == (128001, 128008, 128009)  # config.json's, then generation_config.json's new ones
    with pytest.raises(TypeError):
        config.rope_scaling["factor"] = 2.0  # read-only: a config is a value


def test_old_rope_scaling_type_key_and_qwen2_sliding_everywhere(tmp_path):
    old = dict(LLAMA_31_8B, rope_scaling={**LLAMA_31_8B["rope_scaling"], "type": "llama3"})
    del old["rope_scaling"]["rope_type"]
    assert load_config(_write(tmp_path, old)).rope_scaling["rope_type"] == "llama3"
    qwen = dict(LLAMA_31_8B, architectures=["Qwen2ForCausalLM"], rope_scaling=None, use_sliding_window=True)
    qwen.update(sliding_window=4096, max_window_layers=0)
    assert load_config(_write(tmp_path, qwen)).sliding_window == 4096


def _broken(**changes) -> dict:
    config = json.loads(json.dumps(LLAMA_31_8B))
    for key, value in changes.items():
        if value is _DELETE:
            del config[key]
        else:
            config[key] = value
    return config


_DELETE = object()

BAD_CONFIGS = {
    "unsupported architecture": (_broken(architectures=["GPT2LMHeadModel"]), r"'GPT2LMHeadModel'.* not supported"),
    "no architectures": (_broken(architectures=_DELETE), r"field 'architectures' is missing"),
    "missing hidden_size": (_broken(hidden_size=_DELETE), r"field 'hidden_size' is missing; expected an int"),
    "string layer count": (
        _broken(num_hidden_layers="32"),
        r"field 'num_hidden_layers' is '32' \(str\); expected an int",
    ),
    "bool as vocab size": (_broken(vocab_size=True), r"field 'vocab_size' is True"),
    "negative eps": (_broken(rms_norm_eps=-1.0), r"field 'rms_norm_eps' .* positive"),
    "kv heads not dividing heads": (_broken(num_key_value_heads=5), r"'num_key_value_heads' .* divisor"),
    "unknown rope type": (
        _broken(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        r"rope scaling type 'yarn' \(field 'rope_scaling'\) is not supported; supported: default, llama3",
    ),
    "llama3 without factor": (
        _broken(rope_scaling={"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
        r"field 'rope_scaling.factor' is missing",
    ),
    "gelu mlp": (_broken(hidden_act="gelu"), r"field 'hidden_act' is 'gelu'"),
    "mlp bias": (_broken(mlp_bias=True), r"field 'mlp_bias' is True"),
    "quantized": (_broken(quantization_config={"quant_method": "awq"}), r"quantization_config.quant_method. is .awq"),
    "integer dtype": (_broken(torch_dtype="int8"), r"field 'torch_dtype' is 'int8'"),
    "tie as a string": (_broken(tie_word_embeddings="no"), r"field 'tie_word_embeddings' .* true or false"),
    "bad eos": (_broken(eos_token_id="</s>"), r"field 'eos_token_id' .* token id"),
    "qwen2 window in some layers": (
        _broken(architectures=["Qwen2ForCausalLM"], rope_scaling=None, use_sliding_window=True, sliding_window=16),
        r"sliding window in some layers only",
    ),
}


@pytest.mark.parametrize("config, match", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_config_names_file_and_field(tmp_path, config, match):
    with pytest.raises(ModelLoadError, match=match) as info:
        load_config(_write(tmp_path, config))
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_or_unreadable_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config.json: no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config.json: cannot read config.json as JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=r"holds a list; expected a JSON object"):
        load_config(tmp_path)


_TYPES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_SMALL_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("architecture", sorted(_TYPES))
def test_a_field_left_out_means_what_transformers_config_class_assumes(tmp_path, architecture):
    """rope_theta, rms_norm_eps and the sliding window, absent from config.json, are the defaults of transformers'
    own config class for the architecture (Mixtral's theta is 1e6, Mistral's window 4096), not one number for all."""
    transformers = pytest.importorskip("transformers")
    moe = _SMALL_MOE if "Moe" in architecture or "Mixtral" in architecture else {}
    reference = transformers.AutoConfig.for_model(_TYPES[architecture], **_SMALL, **moe)
    config = {**reference.to_dict(), "architectures": [architecture]}
    for name in ("rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps", "sliding_window"):
        config.pop(name, None)
    loaded = load_config(_write(tmp_path, config))
    default = type(reference)()  # the class's own defaults
    assert loaded.rope_theta == default.rope_parameters["rope_theta"]
    assert loaded.rms_norm_eps == default.rms_norm_eps
    # Mistral's class slides by 4096 by default; Mixtral's does not; Qwen's slide only with use_sliding_window
    window = 0 if "Qwen" in architecture else (getattr(default, "sliding_window", None) or 0)
    assert loaded.sliding_window == window


def test_rope_fields_that_disagree_or_split_by_layer_type_are_refused(tmp_path):
    both = {**LLAMA_31_8B, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    both["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}  # transformers would take this one
    with pytest.raises(ModelLoadError, match="'rope_parameters' and 'rope_scaling' are both set and disagree"):
        load_config(_write(tmp_path, both))
    same = {**LLAMA_31_8B, "rope_parameters": {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0}}
    assert load_config(_write(tmp_path, same)).rope_scaling["rope_type"] == "llama3"  # saying the same is fine
    nested = {**LLAMA_31_8B, "rope_scaling": None, "rope_parameters": {"full_attention": {"rope_type": "linear"}}}
    with pytest.raises(ModelLoadError, match="rope parameters per layer type"):
        load_config(_write(tmp_path, nested))


def test_a_qwen3_moe_sliding_window_is_refused_naming_the_field(tmp_path):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoConfig.for_model("qwen3_moe", **_SMALL, **_SMALL_MOE)
    config = {**reference.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    config.update(use_sliding_window=True, sliding_window=8)
    with pytest.raises(ModelLoadError, match="field 'use_sliding_window' is true"):
        load_config(_write(tmp_path, config))
