"""``load_config`` of Qwen3, Qwen3-MoE and Mixtral: the published configs' fields, and what is refused, by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_port.errors import ModelLoadError
from vllm_port.models import load_config

# The published Qwen3-30B-A3B config.json's fields the loader reads (transformers 4.x spelling).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}


def _write(tmp_path: Path, config: dict, **changes) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


def test_qwen3_30b_a3b_reads_its_experts(tmp_path):
    config = load_config(_write(tmp_path, QWEN3_30B_A3B))
    assert config.qk_norm and config.head_size == 128 and config.q_size == 4096
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (128, 8, 768, True)
    assert moe.sparse_layers == (True,) * 48
    assert 30.0e9 < config.num_parameters < 31.0e9  # "30B": the published count is 30.5B


def test_mixtral_8x7b_reads_its_experts(tmp_path):
    config = load_config(_write(tmp_path, MIXTRAL_8X7B))
    assert not config.qk_norm and not config.attention_bias and config.sliding_window == 0
    assert (config.moe.num_experts, config.moe.top_k, config.moe.renormalize) == (8, 2, True)
    assert 46.5e9 < config.num_parameters < 46.9e9  # the published 46.7B


def test_dense_layers_of_qwen3_moe_follow_mlp_only_layers_and_the_sparse_step(tmp_path):
    config = load_config(
        _write(tmp_path, QWEN3_30B_A3B, num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    )
    assert config.moe.sparse_layers == (False, True, False, True, False, True)


def test_transformers_5_spelling_of_the_expert_count(tmp_path):
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert load_config(_write(tmp_path, raw, num_local_experts=16)).moe.num_experts == 16


@pytest.mark.parametrize(
    ("base", "changes", "message"),
    [
        (QWEN3_30B_A3B, {"num_experts_per_tok": 129}, "field 'num_experts_per_tok' is 129"),
        (QWEN3_30B_A3B, {"num_experts": 0}, "field 'num_experts' is 0"),
        (QWEN3_30B_A3B, {"moe_intermediate_size": None}, "field 'moe_intermediate_size' is None"),
        (QWEN3_30B_A3B, {"mlp_only_layers": "none"}, "field 'mlp_only_layers' is 'none'"),
        (QWEN3_30B_A3B, {"norm_topk_prob": 1}, "field 'norm_topk_prob' is 1"),
        (QWEN3_30B_A3B, {"shared_expert_intermediate_size": 512}, "field 'shared_expert_intermediate_size'"),
        (QWEN3_30B_A3B, {"hidden_act": "gelu"}, "field 'hidden_act'"),
        (QWEN3_30B_A3B, {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28},
         "field 'use_sliding_window' is true"),
        (MIXTRAL_8X7B, {"num_local_experts": 1 << 20}, "field 'num_local_experts'"),
    ],
)  # fmt: skip
def test_what_cannot_run_is_refused_naming_the_field(tmp_path, base, changes, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        load_config(_write(tmp_path, base, **changes))
