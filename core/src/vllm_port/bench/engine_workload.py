"""What ``vllm-port bench engine`` runs: workloads, the random checkpoints built for them, the bytes a decode step reads.

A :class:`Workload` is a model shape and an offline workload, every number a flag. Two families:

- ``llama``: ``LlamaForCausalLM`` (dense SwiGLU MLP); the CPU default and Llama-3-8B's shape;
- ``qwen3_moe``: ``Qwen3MoeForCausalLM`` (per-head q/k norms, every layer's MLP ``num_experts`` routed
  experts of which each token takes ``num_experts_per_tok``); Qwen3-30B-A3B's shape.

:data:`SHAPES` names the presets of ``--shape``, with the published model each takes its shape from.
A preset may run fewer layers than the published model (the random Qwen3-30B-A3B of all 48 layers is
~61 GB in bf16, more than a GPU machine's disk holds beside the run), and the output says so.

Checkpoints (:func:`build_model`) are random-weight ``transformers`` models saved as safetensors, either
``weights="float"`` (every tensor in the workload's dtype, ``save_pretrained``) or ``weights="fp8"``: the
same weights with the decoder layers' seven projections (q/k/v/o, gate/up/down) quantised to
``float8_e4m3fn``, one float32 scale per output channel (each row's amax / 448), written in the
compressed-tensors ``float-quantized`` format with ``strategy: "channel"`` (what
:mod:`vllm_port.models.quantization` reads); the embedding, norms and LM head stay in the dtype.

:func:`step_weight_bytes` and :func:`kv_token_bytes` count what a decode step reads, for the
bandwidth columns of the decode rows.
"""

from __future__ import annotations

import gc
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CPU_WORKLOAD",
    "FAMILIES",
    "FP8_QUANTIZATION_CONFIG",
    "H200_WORKLOAD",
    "QWEN3_30B_A3B_WORKLOAD",
    "SHAPES",
    "WEIGHTS",
    "Shape",
    "Workload",
    "build_model",
    "expected_experts",
    "itemsize",
    "kv_token_bytes",
    "step_weight_bytes",
    "weights_label",
    "write_fp8_checkpoint",
]

#: ``Workload.family`` -> the ``transformers`` class its checkpoints are built with.
FAMILIES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
#: ``Workload.weights``: every tensor in the dtype, or the projections in float8 with per-channel scales.
WEIGHTS = ("float", "fp8")


@dataclass(frozen=True)
class Workload:
    """A model shape and an offline workload (every number a flag of ``vllm-port bench engine``)."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 32000
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    num_requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    dtype: str = "float32"
    #: batch sizes of the decode-rate measurement (the H200 workload); empty: none
    decode_batches: tuple[int, ...] = ()
    #: the :data:`SHAPES` preset this workload starts from ("" for the CPU default)
    shape: str = ""
    #: a key of :data:`FAMILIES`
    family: str = "llama"
    #: each attention head's width; None: ``hidden_size // num_heads``
    head_dim: int | None = None
    #: routed experts per layer (``qwen3_moe``; 0 for a dense model)
    num_experts: int = 0
    #: experts each token takes (``qwen3_moe``)
    num_experts_per_tok: int = 0
    #: each expert's MLP width (``qwen3_moe``)
    moe_intermediate_size: int = 0
    #: whether the top-k routing weights are renormalised to sum to one (``qwen3_moe``)
    norm_topk_prob: bool = True
    #: a key of :data:`WEIGHTS`: how the checkpoint stores its projections
    weights: str = "float"

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, or ``hidden_size // num_heads`` when unset."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def is_moe(self) -> bool:
        """Whether every layer's MLP is routed experts (``qwen3_moe``)."""
        return self.family == "qwen3_moe"


@dataclass(frozen=True)
class Shape:
    """A ``--shape`` preset: its workload and the published model whose shape it has.

    Attributes:
        workload: the preset's workload (``num_layers`` may be fewer than ``model_layers``).
        model: the published model's name, e.g. ``"Qwen3-30B-A3B"``.
        model_layers: the published model's decoder layers.
    """

    workload: Workload
    model: str
    model_layers: int


CPU_WORKLOAD = Workload()
#: Issue 13's GPU workload: Llama-3-8B's shape in bf16, with batch-1 and batch-64 decode rates.
H200_WORKLOAD = Workload(
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    num_requests=256,
    prompt_len=512,
    output_len=256,
    dtype="bfloat16",
    decode_batches=(1, 64),
    shape="llama3-8b",
)
#: Issue 29's MoE workload: Qwen3-30B-A3B's shape in bf16, 8 of its 48 layers (the whole model is ~61 GB).
QWEN3_30B_A3B_WORKLOAD = replace(
    H200_WORKLOAD,  # the same requests, lengths, dtype and decode batches
    hidden_size=2048,
    intermediate_size=6144,  # the config's dense width: unused, every layer is sparse
    num_layers=8,
    num_heads=32,
    num_kv_heads=4,
    vocab_size=151936,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    shape="qwen3-30b-a3b",
    family="qwen3_moe",
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)
#: ``--shape NAME`` -> its preset.
SHAPES: dict[str, Shape] = {
    "llama3-8b": Shape(H200_WORKLOAD, "Llama-3-8B", 32),
    "qwen3-30b-a3b": Shape(QWEN3_30B_A3B_WORKLOAD, "Qwen3-30B-A3B", 48),
}

#: The seven projections of a decoder layer that an fp8 checkpoint stores in float8 (the loader's).
_FP8_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
#: The ``quantization_config`` of an fp8 checkpoint: compressed-tensors, float8 weights, one scale per
#: output channel, activations quantised per token at run time (the ops do so whatever the file says).
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }
    },
}  # fmt: skip
#: Bytes of each safetensors shard an fp8 checkpoint is written in (host memory holds about one).
_SHARD_BYTES = 4 << 30


def weights_label(w: Workload) -> str:
    """How the output names ``w``'s checkpoint: ``"fp8"``, or the float dtype's short name (``"bf16"``)."""
    if w.weights == "fp8":
        return "fp8"
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(w.dtype, w.dtype)


def _hf_config(w: Workload) -> Any:
    """The ``transformers`` config of ``w``'s model."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=w.vocab_size,
        hidden_size=w.hidden_size,
        intermediate_size=w.intermediate_size,
        num_hidden_layers=w.num_layers,
        num_attention_heads=w.num_heads,
        num_key_value_heads=w.num_kv_heads,
        max_position_embeddings=w.max_position_embeddings,
        rope_theta=w.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if w.head_dim is not None:
        common["head_dim"] = w.head_dim
    if w.family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3MoeConfig(
        **common,
        num_experts=w.num_experts,
        num_experts_per_tok=w.num_experts_per_tok,
        moe_intermediate_size=w.moe_intermediate_size,
        norm_topk_prob=w.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def build_model(path: str | os.PathLike[str], w: Workload, seed: int = 0, device: str = "cpu") -> Path:
    """Save a random-weight model of ``w``'s family, shape, dtype and weights at ``path`` (safetensors).

    Weights keep the ``transformers`` initialisation (normal, std 0.02): like a trained model's
    scale, so activations stay finite in bf16 through many layers; a random router so initialised
    routes tokens nearly uniformly over the experts. The same ``seed`` and ``device`` draw the same
    weights, so an fp8 checkpoint is the float one's weights quantised. No tokenizer is saved:
    prompts are token ids.
    """
    import transformers

    torch.manual_seed(seed)
    dtype = getattr(torch, w.dtype)
    with torch.device(device):
        model = getattr(transformers, FAMILIES[w.family])(_hf_config(w)).to(dtype)
    model.config.dtype = dtype  # the checkpoint's dtype in config.json
    path = Path(path)
    try:
        if w.weights == "fp8":
            return write_fp8_checkpoint(model, path)
        model.save_pretrained(path, safe_serialization=True)
        return path
    finally:
        del model
        release_memory(device)


def release_memory(device: str) -> None:
    """Give the memory of what just ran on ``device`` (a model built, a peer's run) back before the next system
    allocates its own.

    Its modules may sit in reference cycles, which only the collector frees; the device module's allocator cache
    (``torch.<device type>.empty_cache``, where it has one) is then emptied, so the next system starts on a device
    that holds nothing of the last one's (16 GB for Llama-3-8B).
    """
    gc.collect()
    empty_cache = getattr(getattr(torch, torch.device(device).type, None), "empty_cache", None)
    if callable(empty_cache):
        empty_cache()


def write_fp8_checkpoint(model: torch.nn.Module, path: Path) -> Path:
    """Write ``model`` at ``path`` with its decoder projections in float8, as :data:`FP8_QUANTIZATION_CONFIG` says.

    Each projection ``[out, in]`` becomes ``weight`` (``float8_e4m3fn``) and ``weight_scale`` (float32
    ``[out, 1]``, each row's amax / 448, :func:`vllm_port.ops.fp8.quantize_fp8_weight`); every other
    tensor is kept as it is. Tensors are quantised where the model lives (fast on a GPU) and written
    in shards of about 4 GiB (with ``model.safetensors.index.json`` when there are several).
    """
    from safetensors.torch import save_file

    from ..ops.fp8 import quantize_fp8_weight

    state = model.state_dict()
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        stored = tensor.numel() * (1 if _FP8_PROJECTION.fullmatch(name) else tensor.element_size())
        if shards[-1] and size + stored > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += stored
    path.mkdir(parents=True, exist_ok=True)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip
    weight_map: dict[str, str] = {}
    total = 0
    with torch.no_grad():
        for names, file in zip(shards, files, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for name in names:
                if _FP8_PROJECTION.fullmatch(name):
                    q, scale = quantize_fp8_weight(state[name], "channel")
                    tensors[name] = q.cpu()
                    tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(-1, 1).cpu()
                else:
                    tensors[name] = state[name].detach().contiguous().cpu()
            save_file(tensors, str(path / file), metadata={"format": "pt"})
            for name, t in tensors.items():
                weight_map[name] = file
                total += t.numel() * t.element_size()
            del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.update(architectures=[type(model).__name__], quantization_config=FP8_QUANTIZATION_CONFIG)
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def expected_experts(w: Workload, batch: int) -> float:
    """Distinct experts one MoE layer reads in a decode step of ``batch`` tokens, under uniform routing.

    The assumption: each token takes ``k = num_experts_per_tok`` of the ``E = num_experts`` experts,
    every expert equally likely and tokens independent. A token then misses a given expert with
    probability ``1 - k / E``, all ``batch`` tokens with ``(1 - k / E) ** batch``, so the expected
    number of experts hit is ``E * (1 - (1 - k / E) ** batch)``: ``k`` at batch 1, nearly ``E`` at a
    large batch (125.9 of Qwen3-30B-A3B's 128 at batch 64). Random weights route close to uniformly;
    a trained model's routing is skewed, and hits fewer experts at a batch above 1.
    """
    e, k = w.num_experts, w.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def itemsize(dtype: str) -> int:
    """Bytes of one element of the torch dtype named ``dtype`` (``"bfloat16"`` -> 2)."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def step_weight_bytes(w: Workload, experts: float | None = None) -> float:
    """Bytes of the weights a decode step reads: all but the embedding table (the LM head included).

    Per layer: the attention projections, the two RMS norms (and Qwen3's per-head q/k norms), and the
    dense MLP, or the router and ``experts`` experts (``None``: all of them; a decode row passes
    :func:`expected_experts`). An fp8 checkpoint's projections count one byte a weight plus a float32
    scale per output channel; everything else is in ``w.dtype``.
    """
    item = itemsize(w.dtype)
    q, kv = w.num_heads * w.head_size, w.num_kv_heads * w.head_size

    def projections(outs: tuple[int, ...], ins: tuple[int, ...]) -> int:
        weights = sum(o * i for o, i in zip(outs, ins, strict=True))
        return weights + 4 * sum(outs) if w.weights == "fp8" else weights * item

    h = w.hidden_size
    attn = projections((q, kv, kv, h), (h, h, h, q))
    norms = (2 * h + (2 * w.head_size if w.is_moe else 0)) * item
    if w.is_moe:
        expert = 3 * h * w.moe_intermediate_size * item
        mlp = w.num_experts * h * item + (w.num_experts if experts is None else experts) * expert
    else:
        i = w.intermediate_size
        mlp = projections((i, i, h), (h, h, i))
    return w.num_layers * (attn + norms + mlp) + (h + w.vocab_size * h) * item


def kv_token_bytes(w: Workload, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's keys and values over every layer: the cache in ``w.dtype``, or one byte an element
    where ``kv_cache_dtype`` is an fp8 one (its per-tensor scales are a few bytes a layer, left out)."""
    element = itemsize(w.dtype) if kv_cache_dtype == "auto" else 1
    return 2 * w.num_layers * w.num_kv_heads * w.head_size * element
