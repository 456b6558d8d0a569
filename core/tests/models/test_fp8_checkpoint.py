"""FP8 checkpoints as Hugging Face writes them, quantised here from a tiny random ``transformers`` Llama.

Each test quantises the decoder layers' seven projections to e4m3 itself (per tensor, per channel or in
128 x 128 blocks), writes safetensors and a ``config.json`` with the format's ``quantization_config``, and
loads the directory. The oracle is ``transformers`` on the *dequantised* weights, in float32. The CPU
provider of ``fp8_linear`` multiplies the dequantised weight exactly (no activation quantisation), so the
logits must agree within float32's ``linear`` tolerance, as the float checkpoints do (``test_llama.py``);
a provider that quantises activations per token (a GPU's) answers within ``fp8_linear``'s own tolerance,
which conformance checks op by op.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_llama import PagedRun, _assert_fp32_close, _sequences
from tiny_models import build_tiny_model

from vllm_port.errors import ModelLoadError
from vllm_port.models import load_model
from vllm_port.ops.fp8 import FP8_MAX, dequantize_fp8_weight, quantize_fp8_weight

_PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
BLOCK = 128

#: format -> (quantization_config, how each weight is quantised, the scale's name, the scale's stored shape)
FORMATS = {
    "fp8 per tensor (vLLM)": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None},
                              "tensor", "weight_scale", "tensor"),
    "fp8 blocks of 128 x 128 (transformers FineGrainedFP8)": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]},
        "block", "weight_scale_inv", "block"),
    "compressed-tensors channel": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": {"dynamic": True, "num_bits": 8,
                           "strategy": "token", "symmetric": True, "type": "float"},
                           "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                       "dynamic": False}}}},
        "channel", "weight_scale", "column"),
    "compressed-tensors tensor (naive-quantized)": (
        {"quant_method": "compressed-tensors", "format": "naive-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                       "symmetric": True, "strategy": "tensor"}}}},
        "tensor", "weight_scale", "one"),
}  # fmt: skip


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128 x 128 blocks, each scaled by its amax / 448 (the last row and column of blocks partial)."""
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.nn.functional.pad(w.abs(), (0, cols * BLOCK - k, 0, rows * BLOCK - n))
    scale = padded.view(rows, BLOCK, cols, BLOCK).amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(path: Path, fmt: str) -> torch.nn.Module:
    """The tiny Llama quantised in ``fmt``, saved at ``path``; returns the HF model holding the dequantised weights."""
    qconfig, granularity, scale_name, stored = FORMATS[fmt]
    model = build_tiny_model("llama")
    tensors = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if not _PROJECTION.fullmatch(name):
                tensors[name] = param.contiguous()
                continue
            if granularity == "block":
                q, scale = _quantize_blocks(param.float())
                full = scale.repeat_interleave(BLOCK, 0)[: q.shape[0]].repeat_interleave(BLOCK, 1)[:, : q.shape[1]]
                dequantized = q.float() * full
            else:
                q, scale = quantize_fp8_weight(param, granularity)
                dequantized = dequantize_fp8_weight(q, scale, torch.float32)
                scale = scale.reshape({"tensor": (), "one": (1,), "column": (-1, 1)}[stored])
            param.copy_(dequantized)  # the oracle runs the weights the checkpoint means
            tensors[name] = q
            tensors[name.removesuffix("weight") + scale_name] = scale.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    config.update(architectures=["LlamaForCausalLM"], dtype="float32")
    (path / "config.json").write_text(json.dumps(config))
    return model.eval()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_logits_match_the_dequantised_model(tmp_path, fmt):
    hf = write_fp8_checkpoint(tmp_path / "fp8", fmt)
    model = load_model(tmp_path / "fp8", torch.device("cpu"), torch.float32)
    layer = model.layers[0]
    assert layer.qkv_weight.dtype == torch.float8_e4m3fn and layer.qkv_scale.dtype == torch.float32
    assert model.lm_head.dtype == torch.float32  # the LM head stays float
    run = PagedRun(model)
    seqs = _sequences([11, 5], model.config.vocab_size)
    for got, tokens in zip(run.step(list(enumerate(seqs))), seqs, strict=True):
        with torch.no_grad():
            want = hf(tokens[None]).logits[0].float()
        _assert_fp32_close(got, want)


def _edit_config(path: Path, **quantization) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("fmt", "edit", "says"),
    [
        ("fp8 per tensor (vLLM)", {"quant_method": "gptq"}, "field 'quantization_config.quant_method' is 'gptq'"),
        ("fp8 per tensor (vLLM)", {"weight_block_size": [128, 64]}, "'quantization_config.weight_block_size'"),
        ("fp8 per tensor (vLLM)", {"scale_fmt": "ue8m0"}, "'quantization_config.scale_fmt' is 'ue8m0'"),
        ("compressed-tensors tensor (naive-quantized)", {"format": "pack-quantized"}, "'quantization_config.format'"),
        (
            "compressed-tensors channel",
            {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "symmetric": True}}}},
            "'quantization_config.config_groups.g.weights.type' is 'int'",
        ),
        # a per-tensor checkpoint declared block-wise: its scales have the wrong shape, named with the tensor
        ("fp8 per tensor (vLLM)", {"weight_block_size": [128, 128]}, "q_proj.weight_scale' is F32 []"),
    ],
)
def test_what_the_loader_cannot_run_is_refused_naming_the_field(tmp_path, fmt, edit, says):
    write_fp8_checkpoint(tmp_path, fmt)
    _edit_config(tmp_path, **edit)
    with pytest.raises(ModelLoadError, match=re.escape(says)):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_a_missing_scale_and_a_zero_scale_are_refused_naming_the_tensor(tmp_path):
    write_fp8_checkpoint(tmp_path, "compressed-tensors channel")
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    scale = "model.layers.1.mlp.down_proj.weight_scale"
    zero = dict(tensors)
    zero[scale] = zero[scale].clone()
    zero[scale][3] = 0.0
    save_file(zero, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor {scale!r} holds a scale that is not finite and > 0")):
        load_model(tmp_path, torch.device("cpu"), torch.float32)
    del tensors[scale]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor {scale!r} is missing")):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_a_float_projection_in_an_fp8_checkpoint_is_refused(tmp_path):
    write_fp8_checkpoint(tmp_path, "fp8 per tensor (vLLM)")
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor {name!r} has dtype F32; expected F8_E4M3")):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_the_engine_generates_what_transformers_does_on_the_dequantised_weights(tmp_path):
    """Greedy through ``LLM`` (block-wise FP8, the format of Qwen3-FP8 and DeepSeek-V3) equals ``transformers``."""
    from vllm_port import LLM, SamplingParams

    hf = write_fp8_checkpoint(tmp_path / "fp8", "fp8 blocks of 128 x 128 (transformers FineGrainedFP8)")
    llm = LLM(str(tmp_path / "fp8"), device="cpu", kv_cache_memory=4 << 20)
    prompt = [5, 17, 33, 2, 9, 101, 7]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert got == want[0, len(prompt) :].tolist()


def test_an_fp8_checkpoint_refuses_tensor_parallelism_naming_why(tmp_path):
    from vllm_port import LLM

    write_fp8_checkpoint(tmp_path / "fp8", "fp8 per tensor (vLLM)")
    with pytest.raises(ModelLoadError, match=r"quantization_config makes an FP8 checkpoint.*tensor_parallel_size > 1"):
        LLM(str(tmp_path / "fp8"), device="cpu", tensor_parallel_size=2, kv_cache_memory=4 << 20)


def test_an_fp8_mixture_of_experts_checkpoint_is_refused_naming_the_field(tmp_path):
    write_fp8_checkpoint(tmp_path, "fp8 per tensor (vLLM)")
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"field 'quantization_config' makes an FP8 checkpoint of a mixture-of-experts"
    ):
        load_model(tmp_path, torch.device("cpu"), torch.float32)
