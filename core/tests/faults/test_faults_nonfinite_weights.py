"""NaN and Inf in the weights are refused at load, naming the tensor and its file (``VLLM_PORT_CHECK_WEIGHTS=0`` skips)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_port import LLM, SamplingParams
from vllm_port.data import bundled_model_dir
from vllm_port.errors import ModelLoadError, SelectionError
from vllm_port.ops.checks import validation

PROJECTION = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.norm.weight"


def damaged_copy(tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of the bundled model whose weights ``change`` edited in place."""
    copy = tmp_path / "model"
    shutil.copytree(bundled_model_dir(), copy)
    tensors = load_file(copy / "model.safetensors")
    change(tensors)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def nan_projection(tensors: dict[str, torch.Tensor]) -> None:
    tensors[PROJECTION].fill_(float("nan"))


def inf_in_norm(tensors: dict[str, torch.Tensor]) -> None:
    tensors[NORM][17] = float("inf")


DAMAGE = {
    "NaN projection": (nan_projection, PROJECTION, "holds 65,536 NaN and 0 infinite value(s) of 65,536"),
    "one Inf in the final norm": (
        inf_in_norm,
        NORM,
        "holds 0 NaN and 1 infinite value(s) of 256 (first at index (17,)",
    ),
}


@pytest.mark.parametrize("mode", ["default", "strict", "validate"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_weights_with_nan_or_inf_are_refused_naming_the_tensor(tmp_path, monkeypatch, damage, mode):
    change, tensor, said = DAMAGE[damage]
    model = damaged_copy(tmp_path, change)
    if mode == "strict":
        monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    with pytest.raises(ModelLoadError) as caught, validation(mode == "validate"):
        LLM(model, device="cpu", kv_cache_memory=4 << 20)
    message = str(caught.value)
    assert f"{model / 'model.safetensors'}: tensor {tensor!r} {said}" in message
    assert "VLLM_PORT_CHECK_WEIGHTS=0 loads it anyway" in message


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_check_weights_0_loads_them_anyway(tmp_path, monkeypatch, damage):
    model = damaged_copy(tmp_path, DAMAGE[damage][0])
    monkeypatch.setenv("VLLM_PORT_CHECK_WEIGHTS", "0")
    with LLM(model, device="cpu", kv_cache_memory=4 << 20) as llm:
        weights = [llm.runner.model.final_norm, *(w for layer in llm.runner.model.layers for w in vars(layer).values())]
        assert not all(
            bool(w.isfinite().all()) for w in weights if isinstance(w, torch.Tensor) and w.is_floating_point()
        )


def test_a_finite_weight_that_overflows_the_target_dtype_is_refused_saying_so(tmp_path):
    def too_big_for_float16(tensors: dict[str, torch.Tensor]) -> None:
        tensors[NORM][3] = 1e6  # fine in bfloat16 (the file's dtype), past float16's 65504

    model = damaged_copy(tmp_path, too_big_for_float16)
    with pytest.raises(
        ModelLoadError,
        match=r"tensor 'model.norm.weight' is finite in the file \(BF16\), but .* "
        r"overflow float16 .*largest magnitude is 9.994e\+05.* load in a wider dtype",
    ):
        LLM(model, device="cpu", dtype="float16", kv_cache_memory=4 << 20)
    with LLM(model, device="cpu", dtype="bfloat16", kv_cache_memory=4 << 20):
        pass


def test_check_weights_takes_only_a_switch(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_CHECK_WEIGHTS", "maybe")
    with pytest.raises(SelectionError, match=r"VLLM_PORT_CHECK_WEIGHTS='maybe' is not a switch; set it to 1 .* or 0"):
        LLM(device="cpu", kv_cache_memory=4 << 20)


def test_nan_weights_loaded_anyway_end_every_request_and_debug_mode_blames_no_provider(tmp_path, monkeypatch):
    model = damaged_copy(tmp_path / "nan", nan_projection)
    monkeypatch.setenv("VLLM_PORT_CHECK_WEIGHTS", "0")
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path / "check"))
    with LLM(model, device="cpu", kv_cache_memory=4 << 20) as llm:
        outputs = [o.outputs[0] for o in llm.generate(["The sea", "Mr. Darcy"], SamplingParams(max_tokens=4))]
        assert [(o.finish_reason, o.token_ids) for o in outputs] == [("error", []), ("error", [])]
        assert (
            "the first output holding NaN or Inf was op 'linear''s call" in outputs[0].error
            and "(provider 'cpu_linear' of plugin 'cpu'), from inputs that already held NaN or Inf (the weights"
            in outputs[0].error
            and outputs[0].error.endswith("; no provider is at fault")
        )
        assert not llm.runner.ops.fallbacks  # nothing quarantined
