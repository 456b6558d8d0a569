"""The engine on an accelerator platform (the GPU runs of ``dev/gpu-run``); skipped where only the CPU is.

The checkpoint is written with ``safetensors`` alone (GPU machines may lack ``transformers``). The
oracle is the same engine on the CPU plugin in float32: greedy tokens on the device in float32
must equal it, with preemption by swap through the platform's pinned host tier and the migrator,
and two devices in tensor parallel must equal one.
"""

from __future__ import annotations

import dataclasses
import itertools
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


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["captured", "eager"])
def test_device_samples_fork_process_and_score_as_the_cpu_does(setup, device_runtime, enforce_eager):
    """``n`` samples forked on the device (the partial block copied there), the logits processors and
    logprobs (the ``process_logits`` and ``top_logprobs`` providers) give the CPU plugin's answer."""
    model_dir, batch, _, _ = setup
    features = dict(repetition_penalty=1.2, frequency_penalty=0.4, logit_bias={7: 5.0}, logprobs=3, prompt_logprobs=2)
    params = SamplingParams(n=3, temperature=0, max_tokens=12, ignore_eos=True, **features)
    cpu = LLM(str(model_dir), device=vllm_port.load(plugins="cpu"), kv_cache_memory=8 << 20)
    device = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, enforce_eager=enforce_eager)
    for want, got in zip(cpu.generate(batch, params), device.generate(batch, params), strict=True):
        for w, g in zip(want.outputs, got.outputs, strict=True):
            assert g.token_ids == w.token_ids
            for we, ge, token in zip(w.logprobs, g.logprobs, g.token_ids, strict=True):
                assert ge[token].logprob == pytest.approx(we[token].logprob, abs=1e-3)
        assert got.outputs[0].token_ids == got.outputs[2].token_ids  # greedy samples agree
        for we, ge in zip(want.prompt_logprobs[1:], got.prompt_logprobs[1:], strict=True):
            assert set(ge) == set(we)
    assert device.scheduler.pool.num_free == device.scheduler.pool.num_blocks


def test_prefill_and_mixed_steps_replay_captured_graphs_on_the_device_as_the_cpu_computes(setup, device_runtime):
    """A budget of 32 tokens a step chunks the prompts and mixes the chunks with decode rows: every step
    replays a captured graph (one row per token in paged attention), greedy tokens equal to the CPU's."""
    if not device_runtime.platform.graph_capture:
        pytest.skip(f"platform {device_runtime.platform.name!r} has no graph capture")
    model_dir, batch, params, want = setup
    llm = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, max_num_seqs=4, max_num_batched_tokens=32)
    assert llm.captured_batch_sizes[-1] == 32
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want
    kinds = llm.runner.steps_by_kind
    assert kinds["prefill replayed"] > 0 and kinds["decode replayed"] > 0 and kinds["eager"] == 0, kinds


def _live_blocks() -> dict[int, int]:
    """Address -> size of every block torch's CUDA caching allocator has handed out and not had back."""
    return {
        block["address"]: block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def _drop_cublas_workspaces() -> None:
    """torch keeps a cuBLAS workspace for each stream a matmul ran on, for the process's life (graph capture runs
    on side streams): not the engine's to give back, so dropped before each reading."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@pytest.mark.parametrize("replay_prefill", [False, True], ids=["decode-replayed", "all-replayed"])
def test_a_closed_captured_engine_gives_its_device_memory_back_without_the_collector(
    setup, device_runtime, replay_prefill
):
    """After ``close()`` and the last reference, the runner, the weights, the KV cache and the graphs' memory pool
    are gone with the collector off: a benchmark's next engine (``vllm-port bench engine``) starts on an empty
    device. On failure the message lists what still holds the runner and the blocks still allocated."""
    import gc
    import weakref

    if not device_runtime.platform.graph_capture or device_runtime.platform.device_type != "cuda":
        pytest.skip("reads CUDA's caching allocator: a CUDA platform with graph capture")
    model_dir, batch, params, want = setup
    torch.accelerator.synchronize()
    gc.collect()
    _drop_cublas_workspaces()
    before = _live_blocks()
    gc.disable()
    try:
        llm = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
        llm.runner.replay_prefill = replay_prefill
        assert llm.captured_batch_sizes
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want
        runner = weakref.ref(llm.runner)
        held = sum(_live_blocks().values()) - sum(before.values())
        llm.close()
        del llm
        torch.accelerator.synchronize()
        _drop_cublas_workspaces()
        left = {address: size for address, size in _live_blocks().items() if address not in before}
        holders = [type(r).__name__ for r in gc.get_referrers(runner())] if runner() is not None else []
        if runner() is not None or left:  # what the collector would free: garbage in cycles, or a process-wide cache
            gc.collect()
            torch.accelerator.synchronize()
            cached = {a: n for a, n in _live_blocks().items() if a not in before}
        assert runner() is None and not left, (
            f"{sum(left.values()):,} of the engine's {held:,} bytes still allocated, in blocks of "
            f"{sorted(left.values(), reverse=True)[:12]} bytes; the runner held by {holders}; after gc.collect() "
            f"{sum(cached.values()):,} bytes are (blocks of {sorted(cached.values(), reverse=True)[:12]})"
        )
    finally:
        gc.enable()


def test_device_preemption_by_swap_keeps_greedy_output(setup, device_runtime):
    if "pinned_host" not in device_runtime.platform.memory_tiers:
        pytest.skip(f"platform {device_runtime.platform.name!r} has no pinned host tier")
    model_dir, batch, params, want = setup
    # 24 blocks of 4 tokens; one block is 2 layers * (k, v) * 4 tokens * 2 heads * 64 * 4 bytes = 8 KiB
    llm = LLM(
        str(model_dir),
        device=device_runtime,
        block_size=4,
        kv_cache_memory=24 * 8192,
        swap_space=64 * 8192,
        async_scheduling=False,  # runner.execute is spied on below; the next test runs ahead
    )
    llm.scheduler.reclaimer = DefaultReclaimer(swap_min_tokens=0)  # swap whatever fits
    swaps = []
    execute = llm.runner.execute
    llm.runner.execute = lambda batch: swaps.append(len(batch.swap_out)) or execute(batch)
    outputs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert sum(o.num_preemptions for o in outputs) > 0 and sum(swaps) > 0
    assert llm.scheduler.pool.num_free == llm.scheduler.pool.num_blocks


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["captured", "eager"])
def test_asynchronous_scheduling_equals_the_synchronous_engine_on_the_device(setup, device_runtime, enforce_eager):
    """Steps launched ahead (their inputs fed on the device from the step before, captured graphs replayed
    over the step before's output buffer), seeded sampling and stops, and preemption by swap: the
    synchronous engine's tokens, and the greedy ones the CPU's."""
    model_dir, batch, params, want = setup
    llm = LLM(
        str(model_dir),
        device=device_runtime,
        kv_cache_memory=8 << 20,
        enforce_eager=enforce_eager,
        async_scheduling=True,
    )
    fed = []
    launch = llm.runner.launch
    llm.runner.launch = lambda b, feed=None: fed.append(feed is not None) or launch(b, feed)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want
    assert sum(fed) > len(fed) // 2
    sampled = [
        SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=10 + 7 * i, stop_token_ids=[3 + i])
        for i in range(len(batch))
    ]
    sync = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, enforce_eager=enforce_eager,
               async_scheduling=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in llm.generate(batch, sampled)] == [
        o.outputs[0].token_ids for o in sync.generate(batch, sampled)
    ]
    assert llm._ahead is None and llm.scheduler.pool.num_free == llm.scheduler.pool.num_blocks
    if "pinned_host" in device_runtime.platform.memory_tiers:
        tight = LLM(str(model_dir), device=device_runtime, block_size=4, kv_cache_memory=24 * 8192, swap_space=64 * 8192,
                    enforce_eager=enforce_eager, async_scheduling=True)  # fmt: skip
        tight.scheduler.reclaimer = DefaultReclaimer(swap_min_tokens=0)  # swap whatever fits
        launches = []  # per launched step: (blocks swapped out, blocks swapped in, fed from the step before)
        launch_tight = tight.runner.launch
        tight.runner.launch = lambda b, feed=None: (
            launches.append((len(b.swap_out), len(b.swap_in), feed is not None)) or launch_tight(b, feed)
        )
        outputs = tight.generate(batch, params)
        assert [o.outputs[0].token_ids for o in outputs] == want and sum(o.num_preemptions for o in outputs) > 0
        # swaps happened in steps that ran ahead: a swap out while the step before was still in flight
        assert sum(out for out, _, _ in launches) > 0 and sum(back for _, back, _ in launches) > 0, launches
        assert any(fed for out, back, fed in launches if out or back), launches
        assert tight._ahead is None and tight.scheduler.pool.num_free == tight.scheduler.pool.num_blocks


def test_two_devices_in_tensor_parallel_equal_one(setup, device_runtime):
    if device_runtime.selected.probe.device_count < 2:
        pytest.skip("tensor parallelism needs two devices")
    model_dir, batch, params, want = setup
    with LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, tensor_parallel_size=2) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want


def test_hopper_prefill_serves_the_engine_within_the_contract(tmp_path, device_runtime, monkeypatch):
    """On sm_90 the CUDA plugin binds its Gluon prefill for bf16 models of head 128. Every call the eager engine makes
    (whole prompts, chunks after a cached prefix, decode tokens mixed with a prefill) passes the op's own check
    against the float64 reference. Greedy tokens are not the oracle: in bf16 a near-tie flips on ulp-level
    differences between two correct kernels (it did, at the fifth token of one prompt, with 0.004-0.008 apart)."""
    candidates = {p.name: p for p in device_runtime.registry.candidates("prefill_attention")}
    if "gluon_hopper_prefill_attention" not in candidates:
        pytest.skip("the Hopper prefill is bound on sm_90 GPUs only")
    from vllm_port.ops import prefill_attention as op

    hopper = candidates["gluon_hopper_prefill_attention"]
    calls: list[tuple[list[int], list[int], str | None]] = []

    def checked(*args):
        cu, seq_lens = args[4].tolist(), args[5].tolist()
        q_lens = [b - a for a, b in itertools.pairwise(cu)]
        calls.append((q_lens, seq_lens, op.check(hopper.fn, args, args[0].dtype)))
        return hopper.fn(*args)

    found = device_runtime.registry.candidates("prefill_attention")
    wrapped = [dataclasses.replace(p, fn=checked) if p is hopper else p for p in found]
    monkeypatch.setitem(device_runtime.registry._providers, "prefill_attention", wrapped)
    monkeypatch.setitem(CONFIG, "hidden_size", 512)  # 4 heads of 128
    monkeypatch.setitem(CONFIG, "max_position_embeddings", 512)
    model_dir = write_checkpoint(tmp_path / "head128")
    gen = torch.Generator().manual_seed(2)
    batch = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in (300, 129, 40, 1, 200)]
    # eager: steps of up to 512 tokens replay captured graphs (paged attention), and this batch has no larger one
    llm = LLM(str(model_dir), device=device_runtime, dtype="bfloat16", kv_cache_memory=64 << 20, swap_space=0,
              max_num_batched_tokens=256, enforce_eager=True)  # fmt: skip
    assert llm.provider_per_op["prefill_attention"] == "gluon_hopper_prefill_attention"
    llm.generate(batch, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [problem for *_, problem in calls] == [None] * len(calls)
    assert any(s > q for q_lens, seq_lens, _ in calls for q, s in zip(q_lens, seq_lens, strict=True))  # a prefix
    assert any(1 in q_lens and max(q_lens) > 1 for q_lens, _, _ in calls)  # decode mixed with a prefill


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["captured", "eager"])
def test_a_mixture_of_experts_model_on_the_device_equals_the_cpu(tmp_path, device_runtime, monkeypatch, enforce_eager):
    """Qwen3-MoE's shape (per-head q/k norms, 8 experts top-2, one dense layer) in float32: the platform's
    ``fused_moe`` (the Triton kernels on a GPU; in a captured decode step too) gives the CPU plugin's tokens."""
    moe = dict(architectures=["Qwen3MoeForCausalLM"], head_dim=64, num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=128, norm_topk_prob=True, mlp_only_layers=[1])  # fmt: skip
    for key, value in moe.items():
        monkeypatch.setitem(CONFIG, key, value)
    model_dir = write_checkpoint(tmp_path / "moe")
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in (9, 40, 3, 70)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(str(model_dir), device=vllm_port.load(plugins="cpu"), kv_cache_memory=8 << 20)
    want = [o.outputs[0].token_ids for o in cpu.generate(batch, params)]
    llm = LLM(str(model_dir), device=device_runtime, kv_cache_memory=8 << 20, swap_space=0, enforce_eager=enforce_eager)
    assert "fused_moe" in llm.provider_per_op
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want
