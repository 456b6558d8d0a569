"""Llama-family models written flat against the contract ops, and their loading from Hugging Face directories.

::

    model = load_model("path/to/Llama-3.1-8B", device, torch.bfloat16)  # config + safetensors + model
    hidden = model.forward(kernels, input_ids, positions, kv_caches, meta)
    logits = model.compute_logits(kernels, hidden)
"""

from __future__ import annotations

from .config import ROPE_TYPES, SUPPORTED_ARCHITECTURES, ModelConfig, load_config
from .llama import AttentionMetadata, LlamaModel, load_model, rope_cos_sin_cache, rope_inverse_frequencies
from .loader import WeightSpec, expected_weights, load_weights

__all__ = [
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "LlamaModel",
    "ModelConfig",
    "WeightSpec",
    "expected_weights",
    "load_config",
    "load_model",
    "load_weights",
    "rope_cos_sin_cache",
    "rope_inverse_frequencies",
]
