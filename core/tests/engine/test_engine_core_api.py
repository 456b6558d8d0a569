"""``LLM``'s engine-core API (``add_request``, ``step``, ``abort_request``): what the server's engine thread drives."""

from __future__ import annotations

import pytest

from vllm_port import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(cpu_runtime) -> LLM:
    return LLM(device=cpu_runtime, kv_cache_memory=2 << 20)


def _drain(llm: LLM) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while llm.has_unfinished_requests():
        for d in llm.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def test_added_requests_step_to_what_generate_makes(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["The sea was", "Once upon a time there", [0, 5, 6, 7]]
    added = [llm.add_request(p, params) for p in prompts]
    assert all(a.error is None for a in added) and added[2].prompt_token_ids == [0, 5, 6, 7]
    deltas = _drain(llm)
    want = llm.generate(prompts, params)
    for a, out in zip(added, want, strict=True):
        mine = deltas[a.request_id]
        assert [t for d in mine for t in d.token_ids] == out.outputs[0].token_ids
        assert "".join(d.text for d in mine) == out.outputs[0].text
        assert [d.finish_reason for d in mine] == [None] * 5 + ["length"]
    assert llm.step() == [] and not llm._live  # nothing left behind


def test_abort_request_frees_the_blocks_at_once(llm: LLM) -> None:
    pool = llm.runner.pool
    free = pool.num_free
    added = llm.add_request("It is a truth universally acknowledged", SamplingParams(max_tokens=200, ignore_eos=True))
    other = llm.add_request("The sea", SamplingParams(temperature=0, max_tokens=3))
    llm.step()
    llm.step()
    assert pool.num_free < free
    assert llm.abort_request(added.request_id) and not llm.abort_request(added.request_id)
    deltas = _drain(llm)
    assert deltas[added.request_id][-1].finish_reason == "abort"
    assert deltas[other.request_id][-1].finish_reason == "length"
    assert pool.num_free == free and not llm.has_unfinished_requests()
    assert not llm.abort_request("no such id")


def test_a_refused_prompt_comes_back_with_its_error_and_no_delta(llm: LLM) -> None:
    added = llm.add_request("x " * 600, SamplingParams(max_tokens=2))
    assert added.error is not None and "max_model_len is 512" in added.error
    assert not llm.has_unfinished_requests() and llm.step() == []
    params = SamplingParams()
    params.temperature = -1.0  # changed after it was checked: checked again
    with pytest.raises(ValueError, match="temperature"):
        llm.add_request("The sea", params)


def test_n_samples_step_and_abort_as_one_request(llm: LLM) -> None:
    """An added request's ``n`` samples come back under its id (``sample_index`` tells them apart), as
    ``generate`` makes them; aborting the request ends every sample and frees their blocks."""
    pool = llm.runner.pool
    free = pool.num_free
    params = SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=5, ignore_eos=True, logprobs=1)
    added = llm.add_request("The sea was", params)
    deltas = _drain(llm)[added.request_id]
    want = llm.generate("The sea was", params)[0].outputs
    for sample in want:
        mine = [d for d in deltas if d.sample_index == sample.index]
        assert [t for d in mine for t in d.token_ids] == sample.token_ids
        assert [lp for d in mine for lp in d.logprobs] == sample.logprobs
        assert mine[-1].finish_reason == "length"
    aborted = llm.add_request("Once upon a time", params)
    llm.step()
    assert llm.abort_request(aborted.request_id) and not llm.abort_request(aborted.request_id)
    last = _drain(llm)[aborted.request_id]
    assert sorted(d.sample_index for d in last if d.finish_reason == "abort") == [0, 1, 2]
    assert pool.num_free == free and not llm._live and not llm.has_unfinished_requests()
