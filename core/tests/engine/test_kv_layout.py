"""The CPU platform's head-major KV cache (``PlatformDescription.kv_head_major``) changes where a cache's rows lie,
not what the engine computes: the same tokens, bit for bit, as the contract's token-major layout."""

from __future__ import annotations

import dataclasses

import pytest
from llm_helpers import make_llm, prompts

import vllm_port
from vllm_port import SamplingParams
from vllm_port.runtime import Runtime


def _generate(model_dir, runtime, batch):
    llm = make_llm(model_dir, runtime, enable_prefix_caching=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        outputs = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12)
        outputs += [o.outputs[0].token_ids for o in llm.generate(batch[:2], seeded)]
        return outputs, llm.runner.kv.head_major
    finally:
        llm.close()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_head_major_and_token_major_caches_generate_the_same_tokens(engine_models, family, monkeypatch):
    shared = prompts([19], seed=4)[0]  # a prefix of more than one 16-token block, cached for the second prompt
    batch = [shared + prompts([5], seed=5)[0], shared + prompts([33], seed=6)[0], prompts([1], seed=7)[0]]
    head_major, was_head_major = _generate(engine_models[family], vllm_port.load(plugins="cpu"), batch)
    description = Runtime.platform.fget
    monkeypatch.setattr(
        Runtime, "platform", property(lambda r: dataclasses.replace(description(r), kv_head_major=False))
    )
    token_major, was_token_major = _generate(engine_models[family], vllm_port.load(plugins="cpu"), batch)
    assert (was_head_major, was_token_major) == (True, False)
    assert head_major == token_major
