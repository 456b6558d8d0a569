"""``vllm_port.importer`` on tiny random ``transformers`` models, CPU, float32.

The oracle is ``transformers`` itself: its ``generate`` (greedy) on the very module that is then
imported and run through the engine.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import pytest
import torch
from tiny_models import build_tiny_model, save_tiny_model

from vllm_port import LLM, SamplingParams
from vllm_port.engine.runner import flat_step
from vllm_port.flat import FlatModel
from vllm_port.flat.inspect import inspect_graphs
from vllm_port.importer import ImporterError, import_model

FAMILIES = ["llama", "qwen2", "mistral", "phi3", "gemma2"]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
#: The least number of distinct tokens in each reference output of 64: equality with the output of
#: a model stuck on a token or two (a dead tiny model) would prove little.
MIN_DISTINCT_TOKENS = 16


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 500, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def assert_lively(want: list[list[int]]) -> None:
    """Each reference output holds at least ``MIN_DISTINCT_TOKENS`` distinct tokens."""
    distinct = [len(set(tokens)) for tokens in want]
    assert min(distinct) >= MIN_DISTINCT_TOKENS, f"distinct tokens in the reference outputs: {distinct}"


def engine_tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_imported_greedy_output_equals_transformers_generate(cpu_runtime, family):
    model = build_tiny_model(family)
    batch = prompts([30, 7])  # 30 + 64: past Mistral's and Gemma-2's window of 8 in prefill and decode
    want = [hf_greedy(model, p, 64) for p in batch]
    assert_lively(want)
    llm = LLM(model, device=cpu_runtime, max_num_batched_tokens=16)  # chunked prefill too
    assert engine_tokens(llm, batch) == want
    assert llm.tokenizer is None and llm.runner.model.report.verify_error < 1e-4


@pytest.mark.slow
def test_llm_imports_a_model_directory_through_transformers(cpu_runtime, tmp_path):
    path = save_tiny_model("qwen2", tmp_path / "qwen2")
    batch = prompts([12])
    want = [hf_greedy(build_tiny_model("qwen2"), p, 64) for p in batch]
    assert_lively(want)
    llm = LLM(path, device=cpu_runtime, importer="hf")
    assert engine_tokens(llm, batch) == want
    assert llm.runner.model.config.architecture == "Qwen2ForCausalLM"


@pytest.mark.slow
def test_every_subgraph_of_a_llama_family_model_maps_to_contract_ops(cpu_runtime):
    model = import_model(build_tiny_model("mistral"), cpu_runtime)
    per_layer = Counter((m.piece, m.pattern) for m in model.report.mapped)
    for i in range(2):
        layer = f"layers.{i}"
        assert per_layer[layer, "rms_norm"] == 2
        assert per_layer[layer, "rotary_embedding"] == 1
        assert per_layer[layer, "gated_mlp"] == 1
        assert per_layer[layer, "linear"] == 4  # q/k/v fused, o, gate/up fused, down
        assert per_layer[layer, "attention"] == 1
    assert {("embed", "embedding"), ("norm", "rms_norm"), ("lm_head", "linear")} <= set(per_layer)
    # what stays native: the residual adds only (the flat passes may fuse them)
    assert Counter(n["op"] for n in model.report.native) == {"aten.add.Tensor": 4}
    assert model.config.sliding_window == 8 and (model.config.num_kv_heads, model.config.head_size) == (1, 128)


class QuickGelu(torch.nn.Module):
    """An activation no contract op computes: ``x * sigmoid(1.702 x)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ScaleNorm(torch.nn.Module):
    """A norm no contract op computes: ``g * x / max(||x||, eps) * sqrt(d)``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.g = torch.nn.Parameter(torch.full((size,), 1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5) * math.sqrt(x.shape[-1])


@pytest.mark.slow
def test_unrecognised_pieces_stay_native_and_still_match_transformers(cpu_runtime):
    model = build_tiny_model("llama")
    for layer in model.model.layers:
        layer.mlp.act_fn = QuickGelu()
    model.model.layers[1].post_attention_layernorm = ScaleNorm(model.config.hidden_size)
    batch = prompts([20, 9], seed=4)
    want = [hf_greedy(model, p, 64) for p in batch]
    assert_lively(want)
    llm = LLM(model, device=cpu_runtime)
    assert engine_tokens(llm, batch) == want
    report = llm.runner.model.report
    patterns = Counter(m.pattern for m in report.mapped)
    assert patterns["gated_mlp"] == 0
    assert patterns["rms_norm"] == 3 + 1  # two per layer but the ScaleNorm, and the final norm
    native = Counter(n["op"] for n in report.native)
    assert native["aten.sigmoid.default"] == 2  # the activation, in both layers
    assert native["aten.linalg_vector_norm.default"] + native["aten.norm.ScalarOpt_dim"] == 1  # the norm
    # inspect shows them as native nodes of the flat graph, in their layer
    graph = inspect_graphs(llm.runner.model, cpu_runtime, torch.float32, ("decode",))
    sigmoid = [n for n in graph["nodes"] if n["op"] == "aten.sigmoid.default"]
    assert [n["kind"] for n in sigmoid] == ["native", "native"]


@pytest.mark.slow
def test_imported_model_runs_as_flat_graphs(cpu_runtime):
    model = build_tiny_model("llama")
    batch = prompts([10, 17], seed=2)
    want = [hf_greedy(model, p, 64) for p in batch]
    assert_lively(want)

    def make_step(runner):
        return flat_step(FlatModel(runner.model, runner.runtime, compile=False, block_size=runner.block_size))

    llm = LLM(model, device=cpu_runtime, make_step=make_step)
    assert engine_tokens(llm, batch) == want
    report = inspect_graphs(llm.runner.model, cpu_runtime, torch.float32, ("decode",))
    ops = Counter(n["op"] for n in report["nodes"] if n["kind"] == "contract")
    assert ops["paged_attention"] == ops["reshape_and_cache"] == ops["rotary_embedding"] == 2
    assert {n["layer"] for n in report["nodes"] if n["op"] == "paged_attention"} == {0, 1}


# --- bad input ---------------------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_naming_what_is_missing(cpu_runtime):
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    with pytest.raises(ImporterError, match=r"GPT2LMHeadModel cannot be imported: .*decoder layers .*Llama"):
        import_model(transformers.GPT2LMHeadModel(config), cpu_runtime)
    with pytest.raises(ImporterError, match="got a str, not a torch.nn.Module"):
        import_model("Llama-3-8B", cpu_runtime)
    with pytest.raises(ImporterError, match="importer 'onnx' is unknown; use one of hf"):
        LLM(build_tiny_model("llama"), device=cpu_runtime, importer="onnx")


@pytest.mark.slow
def test_a_layer_that_cannot_be_traced_is_named_with_the_fix(cpu_runtime):
    model = build_tiny_model("llama")
    mlp = model.model.layers[1].mlp
    plain = mlp.forward
    mlp.forward = lambda x: plain(x) if float(x.sum()) > 0 else -plain(x)  # a host read of a tensor value
    with pytest.raises(ImporterError, match=r"LlamaForCausalLM layers\.1 could not be traced: .*host reads"):
        import_model(model, cpu_runtime)


@pytest.mark.slow
def test_a_skeleton_the_importer_does_not_reproduce_fails_the_import_check(cpu_runtime):
    model = build_tiny_model("qwen2")
    base = model.model.forward

    def scaled(*args, **kwargs):  # as Gemma scales its embeddings, outside every piece the importer traces
        out = base(*args, **kwargs)
        out.last_hidden_state = out.last_hidden_state * 3.0
        return out

    model.model.forward = scaled
    with pytest.raises(ImporterError, match=r"Qwen2ForCausalLM: the import check .* failed") as failure:
        import_model(model, cpu_runtime)
    message = str(failure.value)
    assert re.search(
        r"prefill logits \(11 tokens\) differ by [\d.e-]+ and decode logits \(1 step\) by [\d.e-]+", message
    )
    assert "top-level forward does work outside the pieces" in message and "--device cpu" in message


def test_tensor_parallel_imported_models_are_refused(cpu_runtime):
    with pytest.raises(ImporterError, match="imported models run on one device"):
        LLM(build_tiny_model("llama"), device=cpu_runtime, tensor_parallel_size=2)


@pytest.mark.slow  # importing traces the model: seconds
def test_gpu_memory_utilization_counts_an_imported_models_loaded_weights(cpu_runtime):
    model = build_tiny_model("llama")
    _, total = cpu_runtime.allocator().mem_info()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    llm = LLM(model, device=cpu_runtime, gpu_memory_utilization=(weights + (64 << 20)) / total, max_num_seqs=4)
    assert 0 < llm.runner.pool.num_blocks * llm.runner.layout.block_bytes < 64 << 20
    assert len(engine_tokens(llm, prompts([5]))[0]) == 64
