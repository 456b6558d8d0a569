"""Asynchronous scheduling (``LLM(async_scheduling=True)``): the synchronous engine's outputs, token for token.

Each test runs the same requests through a synchronous and an asynchronous engine and compares every
completion (ids, text, finish reason), and checks that the asynchronous one did run steps ahead (a
step launched with a feed of the previous step's sampled ids) where it could, and not where it must not.
"""

from __future__ import annotations

import dataclasses

import pytest
from llm_helpers import assert_pool_empty, make_llm, prompts

from vllm_port import LLM, SamplingParams
from vllm_port.engine.config import RUNS_AHEAD_BY_DEFAULT, EngineConfig
from vllm_port.engine.request import Request
from vllm_port.engine.scheduler import PLACEHOLDER, Scheduler, SchedulerConfig, SchedulerOutput
from vllm_port.engine.step_ahead import feed_rows
from vllm_port.kv_pool import BlockPool
from vllm_port.reclaimer import DefaultReclaimer


def completions(outputs) -> list[tuple]:
    return [
        (o.prompt_token_ids, c.index, tuple(c.token_ids), c.text, c.finish_reason) for o in outputs for c in o.outputs
    ]


def spy_on_launches(llm: LLM) -> list[bool]:
    """Record, per launched step, whether it was fed from the step before (run ahead of its tokens)."""
    fed: list[bool] = []
    launch = llm.runner.launch

    def spying(batch, feed=None):
        fed.append(feed is not None)
        return launch(batch, feed)

    llm.runner.launch = spying
    return fed


def run_both(make, batch, params) -> tuple[list, list, list[bool], LLM]:
    sync, ahead = make(async_scheduling=False), make(async_scheduling=True)
    fed = spy_on_launches(ahead)
    want = completions(sync.generate(batch, params, use_tqdm=False))
    got = completions(ahead.generate(batch, params, use_tqdm=False))
    assert ahead._ahead is None  # nothing left in flight once the requests are done
    return want, got, fed, ahead


def varied_params(count: int, **common) -> list[SamplingParams]:
    """Greedy and seeded sampling, different lengths, some stopping at a token of their own output."""
    return [
        SamplingParams(
            max_tokens=4 + 5 * (i % 4), temperature=0.0 if i % 2 else 0.9, top_k=20 * (i % 3), seed=i, **common
        )
        for i in range(count)
    ]


def test_continuous_batching_with_more_requests_than_seqs(llama_model, cpu_runtime):
    batch = prompts([5, 17, 1, 9, 30, 3, 12, 8], seed=3)
    make = lambda **kw: make_llm(llama_model, cpu_runtime, max_num_seqs=3, **kw)  # noqa: E731
    want, got, fed, ahead = run_both(make, batch, varied_params(len(batch), ignore_eos=True))
    assert got == want
    assert sum(fed) >= len(fed) // 2, fed  # most steps ran ahead of the step before
    assert_pool_empty(ahead)


def test_stop_tokens_end_requests_whose_next_step_already_ran(llama_model, cpu_runtime):
    """Each request stops at a token its synchronous run produces midway: a row for it already ran after."""
    batch = prompts([6, 11, 4, 15], seed=5)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    free = make_llm(llama_model, cpu_runtime).generate(batch, greedy, use_tqdm=False)
    params = [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[o.outputs[0].token_ids[3 + i]])
        for i, o in enumerate(free)
    ]
    make = lambda **kw: make_llm(llama_model, cpu_runtime, **kw)  # noqa: E731
    want, got, fed, ahead = run_both(make, batch, params)
    assert got == want and any(fed)
    assert all(reason == "stop" for *_, reason in got) and all(len(ids) < 12 for _, _, ids, _, _ in got)
    assert PLACEHOLDER not in [t for _, _, ids, _, _ in got for t in ids]
    assert_pool_empty(ahead)


def spy_on_rows(llm: LLM) -> list[tuple[int, ...]]:
    """Record each launched step's query lengths, one per sequence in it."""
    rows: list[tuple[int, ...]] = []
    launch = llm.runner.launch

    def spying(batch, feed=None):
        rows.append(tuple(batch.query_lens))
        return launch(batch, feed)

    llm.runner.launch = spying
    return rows


@pytest.mark.parametrize("end", ["max_tokens", "max_model_len"])
def test_requests_that_end_by_length_get_no_step_after_their_last_token(llama_model, cpu_runtime, end):
    """A request whose step ahead samples its last token (``max_tokens`` reached, or ``max_model_len``) is not
    scheduled again: with seats and blocks to spare, the asynchronous engine runs the synchronous one's steps, row
    for row. (A one-token run on an H100 computed 4 such rows beside every 4 prompts: 2 more steps, and mixed ones.)"""
    batch = prompts([9, 14, 6, 11, 8, 13, 7, 10], seed=7)
    if end == "max_tokens":
        kw, params = (
            {},
            [SamplingParams(max_tokens=1 + i % 3, temperature=0, ignore_eos=True) for i in range(len(batch))],
        )
    else:  # every request ends at the model length, each after a few tokens
        kw, params = {"max_model_len": 17}, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    make = lambda **kw2: make_llm(llama_model, cpu_runtime, max_num_batched_tokens=24, **kw, **kw2)  # noqa: E731
    sync, ahead = make(async_scheduling=False), make(async_scheduling=True)
    want_rows, got_rows = spy_on_rows(sync), spy_on_rows(ahead)
    fed = spy_on_launches(ahead)
    want = completions(sync.generate(batch, params, use_tqdm=False))
    got = completions(ahead.generate(batch, params, use_tqdm=False))
    assert got == want
    assert {c[4] for c in got} == {"length"}
    assert got_rows == want_rows
    assert any(fed)
    assert_pool_empty(ahead)


def test_preemption_chunked_prefill_and_prefix_hits(llama_model, cpu_runtime, alone):
    """16 blocks of 4 tokens for five requests (preemption by recompute), 8-token steps (chunked
    prefill), and prompts sharing an 11-token prefix (cache hits)."""
    batch, params, _ = alone
    make = lambda **kw: make_llm(  # noqa: E731
        llama_model,
        cpu_runtime,
        block_size=4,
        kv_cache_memory=16 * 4096,
        max_model_len=64,
        max_num_batched_tokens=8,
        **kw,
    )
    sync, ahead = make(async_scheduling=False), make(async_scheduling=True)
    fed = spy_on_launches(ahead)
    want, got = sync.generate(batch, params, use_tqdm=False), ahead.generate(batch, params, use_tqdm=False)
    assert completions(got) == completions(want)
    assert sum(o.num_preemptions for o in got) > 0 and any(fed)
    assert ahead.scheduler.pool.stats().hits > 0
    assert_pool_empty(ahead)


def test_requests_that_need_their_tokens_first_run_synchronously(llama_model, cpu_runtime):
    """Penalties, logprobs and n > 1 read the step's tokens on the host before the next: those steps are not
    run ahead, and the outputs still equal the synchronous engine's."""
    batch = prompts([7, 9, 5], seed=11)
    make = lambda **kw: make_llm(llama_model, cpu_runtime, **kw)  # noqa: E731
    for special in (
        SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.3),
        SamplingParams(max_tokens=6, temperature=0, logprobs=2),
        SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=2),
    ):
        params = [special, SamplingParams(max_tokens=6, temperature=0), SamplingParams(max_tokens=6, temperature=0)]
        want, got, fed, _ = run_both(make, batch, params)
        assert got == want, special
        assert not any(fed), special  # every step has the special request in it


def test_stop_strings_and_text(cpu_runtime):
    """The bundled model with its tokenizer: stop strings found in text decoded while the next step ran."""
    texts = ["Once upon a time", "The cat", "In a small town there lived"]
    free = LLM(device=cpu_runtime).generate(texts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    stops = [o.outputs[0].text[4:7] for o in free]  # a piece of each free run's own text
    params = [SamplingParams(max_tokens=16, temperature=0, stop=[s]) for s in stops]
    want, got, fed, _ = run_both(lambda **kw: LLM(device=cpu_runtime, **kw), texts, params)
    assert got == want and any(fed)
    assert any(reason == "stop" for *_, reason in got)


def test_engine_core_api_with_aborts(llama_model, cpu_runtime):
    """add_request / step / abort_request: an abort between steps drops the token its step ahead computed."""

    def drive(llm: LLM) -> dict[str, list]:
        ids = [
            llm.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)).request_id
            for p in prompts([4, 8, 6], seed=2)
        ]
        seen: dict[str, list] = {i: [] for i in ids}
        steps = 0
        while llm.has_unfinished_requests():
            for delta in llm.step():
                seen[delta.request_id].append((tuple(delta.token_ids), delta.finish_reason))
            steps += 1
            if steps == 3:
                assert llm.abort_request(ids[1])
        return {i: seen[i] for i in ids}

    sync = drive(make_llm(llama_model, cpu_runtime))
    ahead_llm = make_llm(llama_model, cpu_runtime, async_scheduling=True)
    fed = spy_on_launches(ahead_llm)
    assert drive(ahead_llm) == sync and any(fed)
    assert list(sync.values())[1][-1][1] == "abort"
    assert ahead_llm._ahead is None
    assert_pool_empty(ahead_llm)


def test_config_refuses_what_it_cannot_run():
    with pytest.raises(
        ValueError, match=r"async_scheduling=True, tensor_parallel_size=2, .*use async_scheduling=False"
    ):
        LLM(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"distributed_executor_backend='external_launcher'\): asynchronous scheduling"
    ):
        LLM(async_scheduling=True, distributed_executor_backend="external_launcher")
    with pytest.raises(
        ValueError, match=r"LLM\(async_scheduling='yes'\): async_scheduling is 'yes'; it must be True, False or None"
    ):
        LLM(async_scheduling="yes")


def test_by_default_steps_run_ahead_where_measured_and_not_on_a_host(llama_model, cpu_runtime):
    """``async_scheduling=None`` (the default, as vLLM's) runs ahead where it was measured to pay: one device of
    the cuda platform running a core model definition; a host platform ("cpu") gains nothing from it, and ROCm
    and XPU were never measured: they stay synchronous unless asked."""
    assert RUNS_AHEAD_BY_DEFAULT == {"cuda"} and EngineConfig().runs_ahead_on("cuda")
    assert not any(EngineConfig(async_scheduling=None).runs_ahead_on(p) for p in ("cpu", "rocm", "xpu", "newchip"))
    assert EngineConfig(async_scheduling=True).runs_ahead_on("cpu") and EngineConfig(
        async_scheduling=True
    ).runs_ahead_on("rocm")
    assert not EngineConfig(async_scheduling=False).runs_ahead_on("cuda")
    for several in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"devices": ["cpu", "cpu"]},
                    {"distributed_executor_backend": "external_launcher"}, {"importer": "flat"}):  # fmt: skip
        assert not EngineConfig(**several).runs_ahead_on("cuda"), several
    llm = make_llm(llama_model, cpu_runtime)
    assert llm.runs_ahead is False  # resolved for the platform: what the engine does
    # the config stays as given, so a replaced one resolves again (True would refuse tensor parallelism)
    assert llm.engine_config.async_scheduling is None
    assert dataclasses.replace(llm.engine_config, tensor_parallel_size=2).runs_ahead_on("cuda") is False
    llm.close()


def test_a_placeholder_without_a_sampled_row_is_refused():
    """feed_rows is the last check before the model reads ids: a placeholder no step sampled is an engine bug."""
    scheduler = Scheduler(SchedulerConfig(64, 4, 64), BlockPool(16, 4), DefaultReclaimer())
    seq = Request("r0", 0, [5, 6, 7], SamplingParams(max_tokens=4))
    scheduler.add(seq)
    first = scheduler.schedule()
    scheduler.commit(first, first.batch(4))
    assert seq.token_ids == [5, 6, 7, PLACEHOLDER]
    following = scheduler.schedule()
    assert feed_rows(first, following) == ([0], [0])
    stranger = SchedulerOutput(seqs=[], num_new_tokens=[], committed=[])
    with pytest.raises(RuntimeError, match=r"request r0: input position 3 holds a placeholder no step sampled"):
        feed_rows(stranger, following)
