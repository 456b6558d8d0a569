"""Pipeline parallelism on CPU: the model's layers in stages, the residual stream sent from stage to stage.

In one process, stages joined by a communicator that hands each sent tensor to the next stage's
receive compute the whole model's logits bit for bit (uneven splits, tied embeddings, a MoE model
whose stages hold sparse and dense layers). Spawned as gloo ranks by ``LLM(pipeline_parallel_size=2)``,
they give the greedy tokens of one process.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from llm_helpers import make_llm, prompts, token_ids
from tiny_models import save_tiny_model

from vllm_port import SamplingParams
from vllm_port.engine import EngineConfig
from vllm_port.engine.pipeline_parallel import load_stage, stage_layers, stage_step
from vllm_port.engine.runner import eager_step
from vllm_port.models import AttentionMetadata, load_config, load_model


class Handoff:
    """A communicator for stages run one after another in one process: ``send`` queues, ``recv`` takes in order."""

    def __init__(self) -> None:
        self.sent: deque[tuple[torch.Tensor, int]] = deque()

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.sent.append((tensor.clone(), dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        sent, dst = self.sent.popleft()
        assert dst == src + 1, f"rank {src} sent to rank {dst}; stages send to the next"
        assert sent.shape == tensor.shape and sent.dtype == tensor.dtype, (sent.shape, tensor.shape)
        tensor.copy_(sent)


def _caches(model, num_blocks: int = 8, block_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_size)
    return [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype)) for _ in model.layers]


def _steps(n: int) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]]:
    """A prefill of ``n`` tokens in one block table, then one decode step: (ids, positions, meta, logits rows)."""
    ids = torch.tensor(prompts([n + 1], seed=3)[0])
    tables = torch.arange(2, dtype=torch.int32)[None]
    prefill = AttentionMetadata(
        torch.arange(n), tables, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), n,
        is_decode=False,
    )  # fmt: skip
    decode = AttentionMetadata(
        torch.tensor([n]), tables, torch.tensor([n + 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1,
        is_decode=True,
    )  # fmt: skip
    return [
        (ids[:n], torch.arange(n), prefill, torch.tensor([n - 1])),
        (ids[n:], torch.tensor([n]), decode, torch.tensor([0])),
    ]


@pytest.mark.parametrize(
    ("family", "layers", "stages"),
    [("llama", 3, 2), ("llama", 3, 3), ("qwen2", 2, 2), ("qwen3_moe", 2, 2)],
    ids=["llama-3-layers-2-stages", "llama-3-layers-3-stages", "qwen2-tied", "qwen3_moe-sparse-and-dense"],
)
def test_stages_in_turn_compute_the_whole_models_logits_bit_for_bit(family, layers, stages, cpu_runtime, tmp_path):
    model_dir = save_tiny_model(family, tmp_path / family, num_hidden_layers=layers)
    ops = cpu_runtime.bind(torch.float32)
    whole = load_model(model_dir, "cpu", torch.float32)
    whole_step, whole_caches = eager_step(whole, ops), _caches(whole)
    parts = [load_stage(model_dir, torch.device("cpu"), torch.float32, r, stages) for r in range(stages)]
    assert sum(len(p.layers) for p in parts) == layers
    assert [p.embed_tokens is not None for p in parts] == [True] + [whole.config.tie_word_embeddings] * (stages - 1)
    assert [p.lm_head is not None for p in parts] == [False] * (stages - 1) + [True]
    handoff = Handoff()
    steps = [stage_step(p, ops, handoff, r, stages) for r, p in enumerate(parts)]
    caches = [_caches(p) for p in parts]
    with torch.inference_mode():
        for ids, positions, meta, rows in _steps(13):
            want = whole_step(ids, positions, whole_caches, meta, rows)
            outs = [step(ids, positions, cache, meta, rows) for step, cache in zip(steps, caches, strict=True)]
            assert outs[:-1] == [None] * (stages - 1) and not handoff.sent
            assert torch.equal(outs[-1], want)
    # each stage's cache holds its own layers' keys, as the whole model's cache holds them
    stage_caches = [layer for cache in caches for layer in cache]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(stage_caches, whole_caches, strict=True))


def test_the_first_stages_hold_one_layer_more_when_the_layers_do_not_split_evenly():
    assert [stage_layers(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_stage_reads_only_its_own_tensors(llama_model, monkeypatch):
    from vllm_port.models import loader

    read = []
    original = loader._to_target
    monkeypatch.setattr(loader, "_to_target", lambda t, *a: read.append(tuple(t.shape)) or original(t, *a))
    config = load_config(llama_model)
    stage = load_stage(llama_model, torch.device("cpu"), torch.float32, 1, 2)
    assert len(stage.layers) == 1 and stage.embed_tokens is None
    # the last stage: one layer's nine tensors, the final norm and the LM head; no embedding
    assert len(read) == 9 + 2 and (config.vocab_size, config.hidden_size) in read


@pytest.mark.slow
def test_two_stages_generate_what_one_process_does(engine_models, cpu_runtime):
    model_dir = engine_models["llama"]
    batch = prompts([7, 30, 12], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = token_ids(make_llm(model_dir, cpu_runtime).generate(batch, params))
    with make_llm(model_dir, cpu_runtime, pipeline_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert token_ids(llm.generate(batch, params)) == want  # chunked prefill and decode alike
        assert llm.captured_batch_sizes == [] and llm.provider_per_op["linear"] == "cpu_linear"
        pool = llm.scheduler.pool
        assert pool.num_free == pool.num_blocks


def test_more_stages_than_layers_are_refused_before_anything_starts(llama_model, cpu_runtime):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is more stages than the model's 2 layers"):
        make_llm(llama_model, cpu_runtime, pipeline_parallel_size=3)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tensor_parallel_size": 2}, "tensor and pipeline parallelism do not combine yet"),
        (
            {"async_scheduling": True},
            "with tensor or pipeline parallelism or launched ranks use async_scheduling=False",
        ),
        ({"importer": "hf"}, "pipeline stages load their layers from a core model definition's checkpoint"),
        ({"devices": ["cpu"]}, "use tensor_parallel_size=1 and pipeline_parallel_size=1 with placement"),
        ({"make_step": lambda runner: None}, "the ranks run their own steps"),
    ],
)
def test_what_pipeline_stages_do_not_combine_with_is_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(pipeline_parallel_size=2, **fields)
