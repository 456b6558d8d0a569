"""The engine on an accelerator platform (the GPU runs of ``dev/gpu-run``); skipped where only the CPU is.

The checkpoint is written with ``safetensors`` alone (GPU machines may lack ``transformers``). The
oracle is the same engine on the CPU plugin in float32: greedy tokens on the device in float32
must equal it, with preemption by swap through the platform's pinned host tier and the migrator,
and two devices in tensor parallel must equal one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.reclaimer import DefaultReclaimer

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
    bos_token_id=1,
    eos_token_id=2,
)


def write_checkpoint(path: Path) -> Path:
    """A random Llama checkpoint at unit scale (config.json + model.safetensors), without transformers."""
    from vllm_port.models import expected_weights, load_config

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, spec in expected_weights(load_config(path)).items():
        noise = torch.randn(spec.shape, generator=gen)
        tensors[name] = 1.0 + 0.2 * noise if name.endswith("norm.weight") else noise / math.sqrt(spec.shape[-1])
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def device_runtime():
    runtime = vllm_port.load()
    if runtime.platform.device_type == "cpu":
        pytest.skip("no accelerator platform is available here")
    return runtime


@pytest.fixture(scope="module")
def setup(tmp_path_factory, device_runtime):
    model_dir = write_checkpoint(tmp_path_factory.mktemp("gpu-llama"))
    gen = torch.Generator().manual_seed(1)
    batch = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in (9, 40, 17, 3, 25)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    cpu = LLM(str(model_dir), device=vllm_port.load(plugins="cpu"), kv_cache_memory=8 << 20)
    want = [o.outputs[0].token_ids for o in cpu.generate(batch, params)]
    return model_dir, batch, params, want


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["captured", "eager"])
def test_device_greedy_equals_cpu(setup, device_runtime, enforce_eager):
    model_dir, batch, params, want = setup
    llm = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, swap_space=0, enforce_eager=enforce_eager)
    captures = device_runtime.platform.graph_capture and not enforce_eager
    assert bool(llm.captured_batch_sizes) == captures
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want


def test_device_preemption_by_swap_keeps_greedy_output(setup, device_runtime):
    if "pinned_host" not in device_runtime.platform.memory_tiers:
        pytest.skip(f"platform {device_runtime.platform.name!r} has no pinned host tier")
    model_dir, batch, params, want = setup
    # 24 blocks of 4 tokens; one block is 2 layers * (k, v) * 4 tokens * 2 heads * 64 * 4 bytes = 8 KiB
    llm = LLM(str(model_dir), device=device_runtime, block_size=4, kv_cache_memory=24 * 8192, swap_space=64 * 8192)
    llm.scheduler.reclaimer = DefaultReclaimer(swap_min_tokens=0)  # swap whatever fits
    swaps = []
    execute = llm.runner.execute
    llm.runner.execute = lambda batch: swaps.append(len(batch.swap_out)) or execute(batch)
    outputs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.num_preemptions for o in outputs) > 0 and sum(swaps) > 0
    assert llm.scheduler.pool.num_free == llm.scheduler.pool.num_blocks


def test_two_devices_in_tensor_parallel_equal_one(setup, device_runtime):
    if device_runtime.selected.probe.device_count < 2:
        pytest.skip("tensor parallelism needs two devices")
    model_dir, batch, params, want = setup
    with LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, tensor_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want


def test_hopper_prefill_in_the_engine_equals_the_triton_kernel(tmp_path, device_runtime, monkeypatch):
    """On sm_90 the CUDA plugin binds its Gluon prefill for bf16 models of head 128: the engine's greedy tokens
    (prompts of several key tiles, with chunked prefill) equal those with the Triton prefill bound instead."""
    if not any(
        p.name == "gluon_hopper_prefill_attention" for p in device_runtime.registry.candidates("prefill_attention")
    ):
        pytest.skip("the Hopper prefill is bound on sm_90 GPUs only")
    monkeypatch.setitem(CONFIG, "hidden_size", 512)  # 4 heads of 128
    monkeypatch.setitem(CONFIG, "max_position_embeddings", 512)
    model_dir = write_checkpoint(tmp_path / "head128")
    gen = torch.Generator().manual_seed(2)
    batch = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in (300, 129, 40, 1, 200)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(prefill: str | None) -> list[list[int]]:
        if prefill:
            monkeypatch.setenv("VLLM_PORT_OP_PROVIDERS", f"prefill_attention={prefill}")
        llm = LLM(str(model_dir), device=device_runtime, dtype="bfloat16", kv_cache_memory=64 << 20, swap_space=0,
                  max_num_batched_tokens=256)  # fmt: skip
        expected = prefill or "gluon_hopper_prefill_attention"
        assert llm.provider_per_op["prefill_attention"] == expected
        return [o.outputs[0].token_ids for o in llm.generate(batch, params)]

    assert tokens(None) == tokens("triton_prefill_attention")
