"""vLLM's sampling features through ``LLM.generate``, against oracles written here, not the ops' references.

The logits come from ``transformers``' model on the same weights (float32); the penalties and
``min_p`` are applied to them by the plain-torch formulas below (vLLM's semantics, written out
independently of ``vllm_port.ops.logits``), and logprobs are ``torch.log_softmax`` of them in float64.
"""

from __future__ import annotations

import pytest
import torch
from llm_helpers import _hf_model, assert_pool_empty, make_llm, prompts, token_ids

from vllm_port import Logprob, SamplingParams
from vllm_port.engine.request import Request, sample_seed
from vllm_port.engine.scheduler import RowProcessing

#: logprobs of float32 logits from two implementations of one model (and a float32 log-softmax)
LOGPROB_ATOL = 2e-4


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    """``transformers``' float32 logits at every position of ``ids`` (float64 copies)."""
    with torch.no_grad():
        return _hf_model(model_dir)(torch.tensor([ids])).logits[0].double()


def penalised(logits: torch.Tensor, prompt: list[int], output: list[int], rep=1.0, freq=0.0, pres=0.0, bias=None):
    """vLLM's logits processors on one position's logits, written out: bias, repetition, frequency, presence."""
    x = logits.clone()
    for token, value in (bias or {}).items():
        x[token] += value
    for token in set(prompt) | set(output):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token in set(output):
        x[token] -= freq * output.count(token) + pres
    return x


def test_logprobs_are_log_softmax_of_the_models_logits(llama_model, cpu_runtime):
    prompt = prompts([9], seed=3)[0]
    llm = make_llm(llama_model, cpu_runtime)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=2)
    out = llm.generate([prompt], params)[0]
    completion = out.outputs[0]
    tokens = completion.token_ids
    want = torch.log_softmax(hf_logits(llama_model, prompt + tokens), dim=-1)
    assert len(completion.logprobs) == len(tokens)
    for i, (entries, token) in enumerate(zip(completion.logprobs, tokens, strict=True)):
        row = want[len(prompt) - 1 + i]
        assert len(entries) in (4, 5) and token in entries
        assert entries[token].logprob == pytest.approx(float(row[token]), abs=LOGPROB_ATOL)
        assert entries[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(4)
        assert sorted(t for t in entries if entries[t].rank <= 4) == sorted(top.indices.tolist())
        for t, lp in entries.items():
            assert isinstance(lp, Logprob) and lp.logprob == pytest.approx(float(row[t]), abs=LOGPROB_ATOL)
            assert lp.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False)
    total = sum(float(want[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens))
    assert completion.cumulative_logprob == pytest.approx(total, abs=LOGPROB_ATOL * len(tokens))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        entries, row = out.prompt_logprobs[i], want[i - 1]
        assert entries[prompt[i]].logprob == pytest.approx(float(row[prompt[i]]), abs=LOGPROB_ATOL)
        assert {t for t in entries if entries[t].rank <= 2} == set(row.topk(2).indices.tolist())
    assert_pool_empty(llm)


@pytest.mark.parametrize(
    "setup",
    [dict(max_num_batched_tokens=4, block_size=4), dict(block_size=4)],
    ids=["chunked-prefill", "prefix-cache"],
)
def test_prompt_logprobs_do_not_depend_on_chunks_or_cached_prefixes(llama_model, cpu_runtime, setup):
    prompt = prompts([13], seed=11)[0]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    want = make_llm(llama_model, cpu_runtime).generate([prompt], params)[0].prompt_logprobs
    llm = make_llm(llama_model, cpu_runtime, **setup)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # its blocks now cached
    got = llm.generate([prompt], params)[0].prompt_logprobs  # a request with prompt_logprobs recomputes them
    assert [None if e is None else {t: round(v.logprob, 4) for t, v in e.items()} for e in got] == [
        None if e is None else {t: round(v.logprob, 4) for t, v in e.items()} for e in want
    ]


def test_penalties_and_bias_follow_the_formula_on_greedy_rows(llama_model, cpu_runtime):
    prompt = prompts([6], seed=21)[0]
    kwargs = dict(rep=1.5, freq=0.7, pres=0.4, bias={7: 2.5, 40: -3.0})
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        ignore_eos=True,
        repetition_penalty=1.5,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        logit_bias={7: 2.5, 40: -3.0},
    )
    got = make_llm(llama_model, cpu_runtime).generate([prompt], params)[0].outputs[0].token_ids
    want: list[int] = []
    for _ in range(10):  # the oracle's greedy decode, one token at a time
        logits = hf_logits(llama_model, prompt + want)[-1]
        want.append(int(penalised(logits, prompt, want, **kwargs).argmax()))
    assert got == want
    plain = make_llm(llama_model, cpu_runtime).generate([prompt], SamplingParams(temperature=0, max_tokens=10))
    assert plain[0].outputs[0].token_ids != got  # the penalties changed something


def test_min_p_keeps_only_tokens_near_the_top(llama_model, cpu_runtime):
    prompt = prompts([5], seed=2)[0]
    llm = make_llm(llama_model, cpu_runtime)
    sampled = SamplingParams(temperature=1.5, min_p=0.3, max_tokens=12, ignore_eos=True, seed=3, presence_penalty=0.5)
    tokens = llm.generate([prompt], sampled)[0].outputs[0].token_ids
    for i, token in enumerate(tokens):
        x = penalised(hf_logits(llama_model, prompt + tokens[:i])[-1], prompt, tokens[:i], pres=0.5)
        probs = torch.softmax(x / 1.5, dim=-1)
        assert probs[token] >= 0.3 * probs.max() * (1 - 1e-4), f"token {i} drawn below min_p"
    # min_p 1 keeps only the most likely token: sampling becomes greedy
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    top_only = llm.generate([prompt], SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True))
    assert token_ids(top_only) == token_ids(greedy)


def test_a_processed_request_leaves_the_others_in_its_batch_unchanged(llama_model, cpu_runtime):
    batch = prompts([7, 12, 4], seed=5)
    plain = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, max_tokens=8, ignore_eos=True),
    ]
    llm = make_llm(llama_model, cpu_runtime)
    alone = [llm.generate([p], s)[0].outputs[0].token_ids for p, s in zip(batch[:2], plain, strict=True)]
    heavy = SamplingParams(temperature=0.7, seed=1, max_tokens=8, repetition_penalty=2.0, min_p=0.2, logprobs=3,
                           logit_bias={3: 5.0}, allowed_token_ids=list(range(100, 300)))  # fmt: skip
    first = llm.generate(batch, [*plain, heavy])
    assert token_ids(first)[:2] == alone
    assert all(100 <= t < 300 for t in first[2].outputs[0].token_ids)
    again = llm.generate(batch[::-1], [heavy, *plain[::-1]])  # seeded: the same tokens in another batch order
    assert token_ids(again)[::-1] == token_ids(first)
    assert_pool_empty(llm)


def test_min_tokens_holds_back_the_stop_tokens(llama_model, cpu_runtime):
    prompt = prompts([8], seed=6)[0]
    llm = make_llm(llama_model, cpu_runtime)
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = greedy.token_ids[0]
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop]))[0].outputs[0]
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    held = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop], min_tokens=5, ignore_eos=True)
    out = llm.generate([prompt], held)[0].outputs[0]
    assert len(out.token_ids) >= 5 and stop not in out.token_ids[:5]


def test_bad_words_are_never_completed(llama_model, cpu_runtime):
    prompt = prompts([5], seed=8)[0]
    llm = make_llm(llama_model, cpu_runtime)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    tokenizer = llm.tokenizer
    # the first token the model writes unbanned that is a word of its own (its text encodes back to it)
    at, word = next(
        (i, tokenizer.decode([t]))
        for i, t in enumerate(free.token_ids)
        if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word]))[
        0
    ].outputs[0]
    ids = tokenizer.encode(word, add_special_tokens=False)
    assert all(banned.token_ids[i : i + len(ids)] != ids for i in range(len(banned.token_ids)))
    assert banned.token_ids[:at] == free.token_ids[:at] and banned.token_ids[at] != free.token_ids[at]


def test_a_multi_token_bad_word_is_banned_at_its_last_token_only_after_its_prefix():
    params = SamplingParams(bad_words=["x"], min_tokens=2, max_tokens=4)
    seq = Request("r", 0, [1, 2, 3], params, stop_token_ids=[9])
    seq.bad_words_token_ids = [[5], [6, 7, 8]]
    assert RowProcessing.of(seq).banned_token_ids == (9, 5)  # below min_tokens: the stop token too
    seq.append(6)
    seq.append(7)
    assert RowProcessing.of(seq).banned_token_ids == (5, 8)
    seq.append(1)
    assert RowProcessing.of(seq).banned_token_ids == (5,)


def test_ids_outside_the_vocabulary_are_per_request_errors(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    outs = llm.generate(
        prompts([3, 3, 3]),
        [
            SamplingParams(max_tokens=2, logit_bias={512: 1.0}),
            SamplingParams(max_tokens=2, allowed_token_ids=[1, 600]),
            SamplingParams(max_tokens=2),
        ],
    )
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "length"]
    assert "logit_bias names token id(s) [512]" in outs[0].outputs[0].error
    assert "allowed_token_ids names token id(s) [600]" in outs[1].outputs[0].error


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(presence_penalty=2.5), "presence_penalty is 2.5"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty is nan"),
        (dict(repetition_penalty=0.0), "repetition_penalty is 0.0"),
        (dict(min_p=1.5), "min_p is 1.5"),
        (dict(min_tokens=20, max_tokens=10), "min_tokens is 20"),
        (dict(logit_bias={1: 150.0}), "refused, not clamped"),
        (dict(logit_bias={"1": 1.0}), "logit_bias"),
        (dict(allowed_token_ids=[]), "non-empty"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(logprobs=-1), "logprobs is -1"),
        (dict(prompt_logprobs=21), "prompt_logprobs is 21"),
    ],
)
def test_bad_parameters_are_refused_naming_the_field(kwargs, says):
    with pytest.raises(ValueError, match="SamplingParams") as info:
        SamplingParams(**kwargs)
    assert says in str(info.value)


def test_streamed_logprobs_are_one_dict_per_new_token(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    prompt = prompts([4], seed=1)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    deltas = list(llm.stream([prompt], params))
    whole = llm.generate([prompt], params)[0].outputs[0].logprobs
    assert [d.logprobs[0] for d in deltas if d.token_ids] == whole
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)


@pytest.mark.slow
def test_two_ranks_process_and_score_what_one_does(llama_model, cpu_runtime):
    batch = prompts([7, 12], seed=4)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.5, min_p=0.1, logprobs=2, prompt_logprobs=1)  # fmt: skip
    want = make_llm(llama_model, cpu_runtime).generate(batch, params)
    with make_llm(llama_model, cpu_runtime, tensor_parallel_size=2, max_num_batched_tokens=8) as llm:
        got = llm.generate(batch, params)
    assert token_ids(got) == token_ids(want)
    for g, w in zip(got, want, strict=True):
        assert [sorted(e) for e in g.outputs[0].logprobs] == [sorted(e) for e in w.outputs[0].logprobs]
        assert g.prompt_logprobs[1:] and len(g.prompt_logprobs) == len(w.prompt_logprobs)


def test_logprobs_survive_preemption_by_recompute(llama_model, cpu_runtime, alone):
    batch, _, want = alone
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    roomy = make_llm(llama_model, cpu_runtime).generate(batch, params)
    # 16 blocks of 4 tokens: the five requests need up to 14 blocks each at the end (test_llm's preemption)
    tight = make_llm(llama_model, cpu_runtime, block_size=4, kv_cache_memory=16 * 4096, max_model_len=64)
    outputs = tight.generate(batch, params)
    assert token_ids(outputs) == want and sum(o.num_preemptions for o in outputs) > 0
    for got, ref in zip(outputs, roomy, strict=True):
        assert len(got.outputs[0].logprobs) == len(got.outputs[0].token_ids)  # one per token, none repeated
        assert got.outputs[0].cumulative_logprob == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-3)
        assert [e and sorted(e) for e in got.prompt_logprobs] == [e and sorted(e) for e in ref.prompt_logprobs]
    assert_pool_empty(tight)


def test_stop_strings_wait_for_min_tokens(llama_model, cpu_runtime):
    prompt = prompts([6], seed=12)[0]
    llm = make_llm(llama_model, cpu_runtime)
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = free.text[:1]  # the first character the model writes
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop))[0]
    assert early.outputs[0].finish_reason == "stop" and len(early.outputs[0].token_ids) < 4
    held = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stop, min_tokens=4)
    out = llm.generate([prompt], held)[0].outputs[0]
    assert len(out.token_ids) >= 4 and out.token_ids == free.token_ids[: len(out.token_ids)]
    assert out.text.startswith(stop)  # the stop string before min_tokens stays in the text


def test_forked_samples_get_their_own_logprobs_and_processing(llama_model, cpu_runtime):
    """``n`` samples draw their first token from one row of logits each (the fork rows): every sample's
    logprobs and penalties are its own, equal to the same seed run as a separate request."""
    prompt = prompts([7], seed=11)[0]
    llm = make_llm(llama_model, cpu_runtime)
    shared = dict(temperature=1.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    shared |= dict(repetition_penalty=1.3, frequency_penalty=0.5, min_p=0.05)
    together = llm.generate([prompt], SamplingParams(n=3, seed=21, **shared))[0]
    assert [c.index for c in together.outputs] == [0, 1, 2]
    assert len(together.prompt_logprobs) == len(prompt) and together.prompt_logprobs[0] is None
    for sample in together.outputs:
        seed = sample_seed(21, sample.index)
        alone = llm.generate([prompt], SamplingParams(n=1, seed=seed, **shared))[0].outputs[0]
        assert sample.token_ids == alone.token_ids
        assert len(sample.logprobs) == len(sample.token_ids)
        for mine, theirs, token in zip(sample.logprobs, alone.logprobs, sample.token_ids, strict=True):
            assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-6)
            assert mine[token].rank == theirs[token].rank
        assert sample.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-5)
    assert_pool_empty(llm)
