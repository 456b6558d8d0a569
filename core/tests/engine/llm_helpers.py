"""Helpers of the engine tests: building an ``LLM`` on a tiny model, prompts, the ``transformers`` oracle."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import transformers

from vllm_port import LLM


def make_llm(model_dir: Path, runtime, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory", 2 << 20)
    return LLM(str(model_dir), device=runtime, **kwargs)


def prompts(lengths, seed=0, vocab=512):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


@functools.cache
def _hf_model(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: generate all the new tokens
    return model


def hf_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """``transformers`` greedy ``generate`` of ``new_tokens`` tokens after ``prompt``."""
    with torch.no_grad():
        out = _hf_model(model_dir).generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_empty(llm: LLM) -> None:
    pool = llm.scheduler.pool
    pool.check_invariants()
    assert pool.num_free == pool.num_blocks, f"{pool.num_blocks - pool.num_free} block(s) still held"
    if llm.scheduler.swap_pool is not None:
        assert llm.scheduler.swap_pool.num_free == llm.scheduler.swap_pool.num_blocks
