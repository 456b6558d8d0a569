"""``SamplingParams.n``: a request's samples fork from its computed prompt and share its KV blocks.

The oracle of a fork is the same sample run alone: sample ``i`` of a seeded request draws exactly
what a request with seed ``sample_seed(seed, i)`` draws by itself, which holds only if the forked
sample attends to the same keys and values (the shared full blocks and its copy of the partial one).
The scheduler-level tests run on ``FakeRunner``, which checks every attended position's token after
each step, through preemption by swap and by recompute.
"""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, expected_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llm_helpers import assert_pool_empty, make_llm, prompts

from vllm_port import SamplingParams
from vllm_port.engine.request import Request, sample_seed
from vllm_port.engine.scheduler import Scheduler, SchedulerConfig
from vllm_port.kv_pool import BlockPool
from vllm_port.reclaimer import DefaultReclaimer

BLOCK = 4


def forked_request(prompt, n, max_tokens=8, request_id="0"):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n)
    samples = [Request(request_id if i == 0 else f"{request_id}#{i}", 0, prompt, params) for i in range(n)]
    for i, s in enumerate(samples):
        s.sample_index = i
    samples[0].forks = samples[1:]
    return samples


def run(sched, runner, limit=500):
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty
        sched.update(out, runner.execute(out))
        outs.append(out)
        assert len(outs) < limit
    return outs


def assert_pool_empty_(sched):
    for pool in (sched.pool, sched.swap_pool):
        if pool is not None:
            pool.check_invariants()
            assert pool.num_free == pool.num_blocks


def make(num_blocks=64, swap_blocks=0, budget=64, max_seqs=8, reclaimer=None, prefix=True):
    swap = BlockPool(swap_blocks, BLOCK) if swap_blocks else None
    config = SchedulerConfig(min(64, num_blocks * BLOCK), max_seqs, budget, prefix)
    return Scheduler(config, BlockPool(num_blocks, BLOCK), reclaimer or DefaultReclaimer(), swap)


@pytest.mark.parametrize("prompt_len", [6, 8], ids=["partial-last-block", "full-blocks"])
def test_forked_samples_share_full_blocks_and_copy_the_partial_one(prompt_len):
    sched, runner = make(prefix=False), FakeRunner(BLOCK)
    prompt = list(range(10, 10 + prompt_len))
    samples = forked_request(prompt, 3)
    sched.add(samples[0])
    first = sched.schedule()
    assert first.seqs == [samples[0]]  # the prompt is computed once
    batch = first.batch(BLOCK)
    assert batch.sample_rows == [0, 0, 0]  # three draws from its logits
    sched.update(first, runner.execute(first))
    tables = [s.block_table for s in samples]
    assert tables[0][:1] == tables[1][:1] == tables[2][:1]  # the full block, shared
    assert sched.pool.ref_count(tables[0][0]) == 3
    if prompt_len % BLOCK:
        assert len({t[-1] for t in tables}) == 3  # the partial block: one each
        second = sched.schedule()
        assert sorted(second.copies) == sorted((tables[0][-1], t[-1]) for t in tables[1:])
        assert not any(n > 1 for n in second.num_new_tokens)  # nobody recomputes the prompt
        sched.update(second, runner.execute(second))
    run(sched, runner)  # the fake runner checks every sample's cache at every step
    for s in samples:
        assert s.output_token_ids == expected_output(prompt, 8)
    assert_pool_empty_(sched)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_forked_samples_survive_preemption(mode):
    reclaimer = DefaultReclaimer(swap_min_tokens=0) if mode == "swap" else DefaultReclaimer()
    sched = make(num_blocks=9, swap_blocks=16 if mode == "swap" else 0, budget=32, reclaimer=reclaimer)
    runner = FakeRunner(BLOCK)
    groups = [
        forked_request(p, 3, max_tokens=10, request_id=str(i)) for i, p in enumerate(([1, 2, 3, 4, 5], [7, 8, 9]))
    ]
    for i, g in enumerate(groups):
        for s in g:
            s.arrival = i
        sched.add(g[0])
    outs = run(sched, runner)
    assert any(o.preempted for o in outs)
    for g, prompt in zip(groups, ([1, 2, 3, 4, 5], [7, 8, 9]), strict=True):
        for s in g:
            assert s.output_token_ids == expected_output(prompt, 10), s
    assert_pool_empty_(sched)


def test_a_sample_without_room_waits_and_recomputes():
    sched, runner = make(max_seqs=2), FakeRunner(BLOCK)
    samples = forked_request([3, 1, 4, 1, 5, 9], 4)
    sched.add(samples[0])
    run(sched, runner)
    for s in samples:
        assert s.output_token_ids == expected_output([3, 1, 4, 1, 5, 9], 8)
    assert_pool_empty_(sched)


def test_finishing_a_request_before_its_fork_ends_its_samples():
    sched, runner = make(budget=4), FakeRunner(BLOCK)
    samples = forked_request(list(range(1, 11)), 3)  # 10 tokens in chunks of 4: no fork yet after a step
    sched.add(samples[0])
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.finish(samples[0], "abort")
    assert all(s.finish_reason == "abort" for s in samples)
    assert_pool_empty_(sched)


# --- end to end -------------------------------------------------------------------------------------


def test_n_greedy_samples_are_equal_and_indexed(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    (out,) = llm.generate(prompts([21], seed=3), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids and len(out.outputs[0].token_ids) == 12
    assert_pool_empty(llm)


def test_n_seeded_samples_are_the_seeds_run_alone(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    prompt = prompts([21], seed=4)[0]  # one full block of 16 and a partial one: both the share and the copy
    params = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([prompt], SamplingParams(**params, n=3, seed=1234))
    alone = llm.generate([prompt] * 3, [SamplingParams(**params, seed=sample_seed(1234, i)) for i in range(3)])
    got = [c.token_ids for c in out.outputs]
    assert got == [a.outputs[0].token_ids for a in alone]
    assert len({tuple(t) for t in got}) == 3  # distinct draws
    (again,) = llm.generate([prompt], SamplingParams(**params, n=3, seed=1234))
    assert [c.token_ids for c in again.outputs] == got  # reproducible
    assert_pool_empty(llm)


def test_n_samples_use_fewer_blocks_than_separate_requests(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime, enable_prefix_caching=False)
    pool = llm.scheduler.pool
    prompt = prompts([40], seed=5)[0]  # two full blocks and a partial one
    params = dict(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)

    def peak(prompts_, sampling):
        used = 0
        for _ in llm.stream(prompts_, sampling):
            used = max(used, pool.num_blocks - pool.num_free)
        assert pool.num_free == pool.num_blocks
        return used

    forked = peak([prompt], SamplingParams(**params, n=4))
    separate = peak([prompt] * 4, SamplingParams(**params))
    assert forked == 2 + 4 * 2 and separate == 4 * 4  # 64 tokens: 4 blocks a sample, the first 2 shared
    assert_pool_empty(llm)


def test_stream_tells_samples_apart_and_abort_ends_them_all(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, n=3, seed=1)
    seen, ended = {}, {}
    for delta in llm.stream(prompts([9], seed=6), params):
        seen.setdefault(delta.sample_index, []).extend(delta.token_ids)
        if delta.finish_reason:
            ended[delta.sample_index] = delta.finish_reason
        if len(seen.get(2, [])) == 4 and not ended:
            assert llm.abort(delta.request_id)
    assert ended == {0: "abort", 1: "abort", 2: "abort"}
    assert all(len(t) <= 5 for t in seen.values())
    assert_pool_empty(llm)


def test_n_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.n is"):
            SamplingParams(n=bad)


def test_the_layer_by_layer_copy_forks_as_the_migrator_does(llama_model, cpu_runtime, monkeypatch):
    llm = make_llm(llama_model, cpu_runtime)
    prompt = prompts([21], seed=4)[0]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=2, seed=99)
    (want,) = llm.generate([prompt], params)
    monkeypatch.setattr(llm.runner.kv, "blocks", None)  # as a placed model's cache, over several platforms
    (got,) = llm.generate([prompt], params)
    monkeypatch.undo()  # before the engine closes its cache
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert_pool_empty(llm)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 4)), min_size=1, max_size=5),
    num_blocks=st.integers(10, 24),
    budget=st.integers(1, 24),
    max_seqs=st.integers(1, 8),
    swap=st.booleans(),
)
def test_any_workload_of_forked_samples_finishes_correctly(requests, num_blocks, budget, max_seqs, swap):
    """Random prompts with random ``n``, pool sizes, budgets and ``max_num_seqs``, with swap or recompute: every
    sample's output is the fake model's on its prompt alone (the fake runner checks every cache read), and no
    block is left behind."""
    reclaimer = DefaultReclaimer(swap_min_tokens=4)
    sched = make(num_blocks, 16 if swap else 0, budget, max_seqs, reclaimer)
    sched.config = SchedulerConfig(36, max_seqs, budget, True)
    runner = FakeRunner(BLOCK)
    groups = []
    for i, (length, max_tokens, n) in enumerate(requests):
        group = forked_request([(i + 5) % 90] * length, n, max_tokens, request_id=str(i))
        for s in group:
            s.arrival = i
        sched.add(group[0])
        groups.append(group)
    run(sched, runner, limit=3000)
    for group in groups:
        for s in group:
            want = expected_output(s.prompt_token_ids, s.params.max_tokens)
            assert s.output_token_ids == want[: 36 - s.num_prompt_tokens], s
    assert_pool_empty_(sched)
