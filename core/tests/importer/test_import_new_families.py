"""The importer on the families of issue 29: Qwen3 imported, MoE and Gemma-3 refused clearly, and the
bfloat16 import check's tolerance scaled by transformers' own bfloat16 error (its float32 second opinion)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import build_tiny_model

from vllm_port.importer import ImporterError, _verify, import_model


@pytest.mark.slow
def test_qwen3_imports_and_its_greedy_tokens_are_transformers(cpu_runtime):
    from vllm_port.importer._verify import _run_imported

    model = build_tiny_model("qwen3")
    imported = import_model(model, cpu_runtime)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids[None], use_cache=False).logits[0]
    got = _run_imported(imported, cpu_runtime, ids)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) < 1e-3 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize(("family", "field"), [("qwen3_moe", "num_local_experts"), ("mixtral", "num_local_experts")])
def test_mixture_of_experts_is_refused_pointing_at_the_core_path(cpu_runtime, family, field):
    with pytest.raises(ImporterError, match=rf"mixture-of-experts \(config.{field}=\d+\) is not supported by the "
                       r"importer; load it with the core path"):  # fmt: skip
        import_model(build_tiny_model(family), cpu_runtime)


def test_gemma3s_rotary_per_layer_type_is_refused_not_a_type_error(cpu_runtime):
    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(config).eval()
    with pytest.raises(ImporterError, match=r"Gemma3RotaryEmbedding\) takes a layer_type: one rotary table per layer"):
        import_model(model, cpu_runtime)


LLAMA_48 = dict(head_dim=48, hidden_size=192, num_attention_heads=4, num_key_value_heads=1)


@pytest.mark.slow
def test_a_correct_bfloat16_import_past_the_fixed_tolerance_passes_on_the_float32_truth(cpu_runtime, monkeypatch):
    """A correct Llama with head_dim 48 whose bfloat16 logits differ from transformers' by more than the fixed
    tolerance (here made 0.002 so that the tiny model crosses it, as a real one crossed 0.1): the float32 second
    opinion finds it as close to the truth as transformers' own bfloat16 run, and passes it."""
    monkeypatch.setitem(_verify.VERIFY_TOLERANCE, torch.bfloat16, 2e-3)
    monkeypatch.setitem(_verify.TIE_MARGIN, torch.bfloat16, 10.0)  # the greedy test is not this test's
    error = import_model(build_tiny_model("llama", **LLAMA_48), cpu_runtime, torch.bfloat16).report.verify_error
    assert error > 2e-3


class _Scaled:
    """An imported model whose logits come out 3% too large: an error no rounding makes."""

    def __init__(self, model) -> None:
        self.model, self.config, self.dtype, self.device = model, model.config, model.dtype, model.device

    def forward(self, *args):
        return self.model.forward(*args)

    def compute_logits(self, ops, hidden):
        return self.model.compute_logits(ops, hidden) * 1.03


@pytest.mark.slow
def test_a_wrong_bfloat16_import_is_still_refused_with_both_measurements(cpu_runtime, monkeypatch):
    monkeypatch.setitem(_verify.VERIFY_TOLERANCE, torch.bfloat16, 2e-3)
    monkeypatch.setitem(_verify.TIE_MARGIN, torch.bfloat16, 10.0)
    model = build_tiny_model("llama", **LLAMA_48)
    imported = import_model(model, cpu_runtime, torch.bfloat16, verify=False)
    with pytest.raises(ImporterError, match=r"Against transformers in float32 the imported logits are off by"):
        _verify.verify_import(_Scaled(imported), model, cpu_runtime)
