"""The engine with ``kv_cache_dtype="fp8"``: an e4m3 paged cache, sized by its dtype, read through the ``*_fp8`` ops.

Two oracles. Exact: the fp8-cache step equals a float32 step whose cache holds the same keys and values rounded
to e4m3 first (what the fp8 ops promise: nothing but that rounding), within float32's ``linear`` tolerance.
Close: against the plain float32 cache, the logits move by that rounding alone. e4m3 keeps 4 significant bits, so
each cached key and value errs by up to 2^-4 of itself (3.6% RMS); on these unit-scale random models, whose
attention is sharp, that moves the logits by up to 28% of their standard deviation (measured on the three families:
16-28%), so the stated tolerance is 35% of the logits' standard deviation, with the greedy token kept at 85% of
positions or more. Real checkpoints' logits move far less (vLLM's own FP8 KV cache accuracy reports).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from llm_helpers import make_llm, prompts

from vllm_port import SamplingParams
from vllm_port.ops.kv_fp8 import quantize_kv

cpu_attention = pytest.importorskip("vllm_port_cpu.attention")

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import PagedRun, _assert_fp32_close, _sequences  # noqa: E402

from vllm_port.models import load_model  # noqa: E402


class _RoundingCache:
    """Bound ops whose cache write rounds keys and values to e4m3 (scale 1) in a float32 cache: the exact oracle.

    Attention runs the CPU plugin's torch kernels, which its FP8 providers run on the dequantised blocks: the
    native kernels sum in another order, and one float32 ulp in a layer's output can move a key across an e4m3
    rounding edge in the next layer's cache (0.03 there, 5e-4 in the logits).
    """

    def __init__(self, ops) -> None:
        self._ops = ops
        self.paged_attention = cpu_attention.paged_attention.fn
        self.prefill_attention = cpu_attention.prefill_attention.fn

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        rounded = quantize_kv(key, 1.0).to(key.dtype), quantize_kv(value, 1.0).to(value.dtype)
        self._ops.reshape_and_cache(*rounded, key_cache, value_cache, slot_mapping)


def _runs(model_dir: Path):
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    plain, rounded, fp8 = PagedRun(model), PagedRun(model), PagedRun(model)
    rounded.ops = _RoundingCache(rounded.ops)
    fp8.kv_caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in fp8.kv_caches]
    return model, plain, rounded, fp8


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fp8_cache_logits_equal_rounded_cache_and_stay_close_to_float(engine_models, family):
    model, plain, rounded, fp8 = _runs(engine_models[family])
    seqs = _sequences([13, 21, 6], model.config.vocab_size)
    steps = [list(enumerate(seqs))]
    got = {name: run.step(steps[0]) for name, run in (("plain", plain), ("rounded", rounded), ("fp8", fp8))}
    nxt = [(i, torch.tensor([int(x[-1].argmax())])) for i, x in enumerate(got["plain"])]
    for name, run in (("plain", plain), ("rounded", rounded), ("fp8", fp8)):
        got[name] += run.step(nxt)  # a decode step reads the prefill's e4m3 cache through paged_attention_fp8
    for a, b in zip(got["fp8"], got["rounded"], strict=True):
        _assert_fp32_close(a, b)
    float_logits, fp8_logits = torch.cat(got["plain"]), torch.cat(got["fp8"])
    moved = float((fp8_logits - float_logits).abs().max())
    spread = float(float_logits.std())
    assert moved <= 0.35 * spread, f"fp8 cache moved the logits by {moved:.3f}, over 35% of their spread {spread:.3f}"
    agree = float((fp8_logits.argmax(-1) == float_logits.argmax(-1)).float().mean())
    assert agree >= 0.85, f"greedy tokens agree at {agree:.0%} of positions"


def test_llm_with_fp8_cache_holds_more_blocks_and_generates(llama_model, cpu_runtime):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = make_llm(llama_model, cpu_runtime, kv_cache_memory=2 << 20)
    fp8 = make_llm(llama_model, cpu_runtime, kv_cache_memory=2 << 20, kv_cache_dtype="fp8")
    assert fp8.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert fp8.runner.pool.num_blocks == 4 * plain.runner.pool.num_blocks  # 1 byte an element against float32's 4
    batch = prompts([9, 17, 30])
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    got = [o.outputs[0].token_ids for o in fp8.generate(batch, params)]
    assert all(len(g) == 12 for g in got)
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert same >= 0.5 * 36, f"only {same} of 36 greedy tokens equal the float cache's"


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "bfloat16", None])
def test_kv_cache_dtype_refuses_what_it_cannot_run_naming_the_field(llama_model, cpu_runtime, bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype is .*; it must be 'auto' \(the model's dtype\) or 'fp8'"):
        make_llm(llama_model, cpu_runtime, kv_cache_dtype=bad)


def test_samples_sharing_a_partial_prompt_block_copy_it_in_the_fp8_cache(llama_model, cpu_runtime):
    """n samples copy the prompt's partial last block on write: the migrator copies e4m3 blocks as bytes."""
    llm = make_llm(llama_model, cpu_runtime, kv_cache_memory=96 << 10, block_size=4, kv_cache_dtype="fp8")
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(range(5, 18))}], params)  # 13 tokens: the 4th block partial
    assert [len(c.token_ids) for c in outs[0].outputs] == [20, 20, 20]


def _flat(cache_dtype):
    from vllm_port.engine.runner import flat_step
    from vllm_port.flat import FlatModel

    def make_step(runner):
        dtype = runner.layout.dtype if cache_dtype == "runner" else cache_dtype
        flat = FlatModel(runner.model, runner.runtime, compile=False, block_size=runner.block_size, cache_dtype=dtype)
        return flat_step(flat)

    return make_step


def test_the_flat_graphs_traced_for_the_fp8_cache_generate_what_the_model_forward_does(llama_model, cpu_runtime):
    """The flat graphs (the default step where the platform captures graphs) trace the ``*_fp8`` cache ops when told
    the cache's dtype: before, a GPU engine with ``kv_cache_dtype="fp8"`` called ``reshape_and_cache`` on it."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts([9, 17, 30])
    eager = make_llm(llama_model, cpu_runtime, kv_cache_dtype="fp8")
    flat = make_llm(llama_model, cpu_runtime, kv_cache_dtype="fp8", make_step=_flat("runner"))
    want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert [o.outputs[0].token_ids for o in flat.generate(batch, params)] == want


def test_flat_graphs_take_the_first_caches_dtype_when_not_told(llama_model, cpu_runtime):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eager = make_llm(llama_model, cpu_runtime, kv_cache_dtype="fp8")
    flat = make_llm(llama_model, cpu_runtime, kv_cache_dtype="fp8", make_step=_flat(None))
    batch = prompts([7, 12])
    want = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
    assert [o.outputs[0].token_ids for o in flat.generate(batch, params)] == want


def test_flat_graphs_refuse_a_cache_of_another_dtype_naming_both(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime, kv_cache_dtype="fp8", make_step=_flat(torch.float32))
    with pytest.raises(ValueError, match=r"traced for KV caches of torch.float32, given torch.float8_e4m3fn"):
        llm.generate(prompts([5]), SamplingParams(max_tokens=2))
