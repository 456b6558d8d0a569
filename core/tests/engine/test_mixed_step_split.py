"""The runner tells the attention how many decode rows lead a mixed step (``AttentionMetadata.num_decodes``), and
an engine whose mixed steps split their attention generates what one that does not split does."""

from __future__ import annotations

import pytest
from llm_helpers import make_llm, prompts

import vllm_port.engine.runner as runner_module
from vllm_port import SamplingParams
from vllm_port.engine.runner import _leading_decode_rows


@pytest.mark.parametrize(
    ("query_lens", "leading"), [([1, 1, 5, 1], 2), ([3, 1], 0), ([1, 1], 2), ([7], 0), ([1, 4, 4], 1)]
)
def test_the_leading_decode_rows_are_counted_up_to_the_first_chunk(query_lens, leading):
    assert _leading_decode_rows(query_lens) == leading


def test_mixed_steps_split_their_attention_and_generate_what_unsplit_steps_do(llama_model, cpu_runtime, monkeypatch):
    batch = prompts([23, 5, 17, 30, 9], seed=7)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seen: list[int] = []
    tensors = runner_module.ModelRunner._tensors

    def recording(self, batch):
        out = tensors(self, batch)
        seen.append(out[2].num_decodes)
        return out

    monkeypatch.setattr(runner_module.ModelRunner, "_tensors", recording)
    # a small step budget: later prompts are prefilled in chunks beside the earlier ones' decode rows
    split = [
        o.outputs[0].token_ids
        for o in make_llm(llama_model, cpu_runtime, max_num_batched_tokens=16).generate(batch, params)
    ]
    assert max(seen) > 0, "no mixed step led by decode rows: the workload no longer makes one"
    monkeypatch.setattr(runner_module, "_leading_decode_rows", lambda query_lens: 0)
    unsplit = [
        o.outputs[0].token_ids
        for o in make_llm(llama_model, cpu_runtime, max_num_batched_tokens=16).generate(batch, params)
    ]
    assert split == unsplit
