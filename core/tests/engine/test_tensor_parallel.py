"""Tensor parallelism on CPU: two gloo ranks in worker processes give the greedy tokens of one.

The tiny Llama has one key/value head (each rank keeps it); the tiny Qwen2 has two (one per rank),
with biases on q/k/v and tied embeddings.
"""

from __future__ import annotations

import pytest
import torch
from llm_helpers import make_llm, prompts, token_ids

from vllm_port import SamplingParams
from vllm_port.engine.tensor_parallel import shard_config, shard_weights
from vllm_port.models import load_config, load_weights


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_two_ranks_generate_what_one_does(engine_models, cpu_runtime, family):
    model_dir = engine_models[family]
    batch = prompts([7, 30, 12], seed=4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = token_ids(make_llm(model_dir, cpu_runtime).generate(batch, params))
    with make_llm(model_dir, cpu_runtime, tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        assert token_ids(llm.generate(batch, params)) == want  # chunked prefill and decode alike
        assert llm.provider_per_op["linear"] == "cpu_linear"
        pool = llm.scheduler.pool
        assert pool.num_free == pool.num_blocks


def test_shards_put_together_give_the_full_weights(llama_model):
    config = load_config(llama_model)
    full = load_weights(llama_model, config, "cpu", torch.float32)
    shards = [shard_weights(config, dict(full), r, 2) for r in range(2)]
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(torch.cat([s[q] for s in shards]), full[q], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s[o] for s in shards], dim=1), full[o], rtol=0, atol=0)
    k = "model.layers.0.self_attn.k_proj.weight"  # one key/value head: both ranks keep it
    assert all(torch.equal(s[k], full[k]) for s in shards)
    local = shard_config(config, 1, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, config.intermediate_size // 2)


def test_a_size_that_does_not_split_the_model_is_refused_before_anything_starts(llama_model, cpu_runtime):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not split num_attention_heads=4"):
        make_llm(llama_model, cpu_runtime, tensor_parallel_size=3)


def test_a_rank_builds_its_rotary_table_for_the_engines_context_not_the_configs(llama_model):
    """A shard's rope table has the rows the engine asks for (its max_model_len), as a one-device model's has."""
    from vllm_port.engine.tensor_parallel import load_shard

    shard = load_shard(llama_model, torch.device("cpu"), torch.float32, 1, 2, max_positions=48)
    assert shard.max_positions == 48
    assert shard.cos_sin_cache.shape[0] == 48
