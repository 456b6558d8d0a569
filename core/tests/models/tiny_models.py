"""Tiny random Hugging Face checkpoints of each supported family, built with ``transformers``.

The fixtures of ``conftest.py`` save one of each with ``save_pretrained`` (safetensors):

- ``llama_dir``: Llama 3.1 (``llama3`` rope scaling), 4 heads of 64 over 1 KV head (GQA 4), head_dim set explicitly.
- ``qwen2_dir``: Qwen2 with q/k/v biases and tied embeddings, 4 heads of 64 over 2 KV heads.
- ``mistral_dir``: Mistral with a sliding window of 8 (shorter than the tests' sequences), 2 heads of 128
  over 1 KV head.

``build_tiny_model`` also builds the importer-only families: ``phi3`` (fused ``qkv_proj`` and
``gate_up_proj``, 2 heads of 96 over 1 KV head) and ``gemma2`` (scaled embeddings, ``(1 + w)``
norms before and after attention and MLP, GELU-tanh, attention soft cap 2 and final soft cap 5 so
that both act, sliding window 8 on alternate layers).

``build_tiny_model`` builds the newer families too (``NEW_FAMILY_CONFIGS``, kept apart so that the
many tests iterating ``TINY_CONFIGS`` do not grow): ``qwen3`` (per-head q/k RMS norm, explicit
head_dim 32 over hidden 128), ``qwen3_moe`` (8 experts of 64, top-2 without renormalisation, the
second layer dense through ``mlp_only_layers``) and ``mixtral`` (4 experts, top-2, renormalised).

``tiny_model_dirs`` maps each family to its directory. Weights are re-drawn at unit scale (the
transformers initialisation is so small that every layer is nearly the identity, which would let a
wrong rotary table or bias pass unseen); norm weights and biases are random too. Each family's greedy
output on random prompts holds many distinct tokens (the importer's tests assert it), so that a test
comparing 64 greedy tokens compares a live model, not one stuck on a token.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

#: Family -> (transformers config class name, model class name, config arguments).
TINY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=64,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=[2, 3],
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            hidden_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=None,
            eos_token_id=4,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            sliding_window=8,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
}
#: Families only the importer runs (no core model; kept apart from ``TINY_CONFIGS``, which the core
#: model's tests iterate): Phi-3 fuses q/k/v and gate/up in its checkpoint; Gemma-2 scales its
#: embeddings, norms by (1 + w), soft-caps attention and logits, alternates windowed layers.
IMPORT_ONLY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            hidden_size=192,
            num_attention_heads=2,
            num_key_value_heads=1,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            original_max_position_embeddings=256,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=5.0,
            rope_theta=10000.0,
            hidden_activation="gelu_pytorch_tanh",
            bos_token_id=2,
            eos_token_id=1,
            pad_token_id=0,
            # untied: with tied embeddings scaled by sqrt(hidden), a random model predicts the token it
            # reads, and greedy output repeats one token, which would test nothing
            tie_word_embeddings=False,
        ),
    ),
}
#: Families of issue 29 that the core model runs (tested in ``core/tests/engine/test_new_families.py``).
NEW_FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
             tie_word_embeddings=False, bos_token_id=None, eos_token_id=4),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
             mlp_only_layers=[1], tie_word_embeddings=False, bos_token_id=None, eos_token_id=4),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
             num_experts_per_tok=2, intermediate_size=96, rope_theta=1000000.0, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2),
    ),
}  # fmt: skip
_COMMON = dict(
    vocab_size=512, intermediate_size=256, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5
)


def build_tiny_model(family: str, seed: int = 0, **overrides):
    """A random ``transformers`` model of ``family`` at unit-scale weights (float32, eager attention)."""
    import transformers

    config_cls, model_cls, kwargs = {**TINY_CONFIGS, **IMPORT_ONLY_CONFIGS, **NEW_FAMILY_CONFIGS}[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                # small: a value bias passes attention's average whole while the values' random part
                # shrinks, so at 0.5 it outweighed every position's context and Qwen2's 64 greedy
                # tokens held 1 to 8 distinct ones; at 0.1 it still moves logits far past any tolerance
                param.copy_(0.1 * noise)
            elif name.endswith("embed_tokens.weight") and config.tie_word_embeddings:
                # half scale: the token read also scores itself through the tied LM head, and at unit
                # scale that pulled greedy output into loops of a few tokens
                param.copy_(0.5 * noise / math.sqrt(param.shape[1]))
            else:  # a linear [out, in] (or an untied embedding): unit-scale outputs for unit inputs
                param.copy_(noise / math.sqrt(param.shape[1]))
    return model


def save_tiny_model(family: str, path: Path, **overrides) -> Path:
    """Build a tiny model of ``family`` and save it as a Hugging Face directory (safetensors) at ``path``."""
    build_tiny_model(family, **overrides).save_pretrained(path)
    return path
