"""The scheduler alone, device-free: batching, chunked prefill, prefix caching, preemption, fairness.

Every run goes through :class:`FakeRunner`, which checks after each step that every position a
sequence attends to holds that sequence's token, so a wrong prefix hit, swap or block reuse fails
the step that makes it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fake_runner import VOCAB, FakeRunner, expected_output
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import vllm_port
from vllm_port.engine import SamplingParams
from vllm_port.engine.request import Request, RequestStatus
from vllm_port.engine.scheduler import Scheduler, SchedulerConfig
from vllm_port.errors import MemoryContractError
from vllm_port.kv_pool import BlockPool
from vllm_port.reclaimer import DefaultReclaimer, Preemption, ReclaimPlan

BLOCK = 4


def make(num_blocks=64, swap_blocks=0, budget=64, max_seqs=8, max_len=None, reclaimer=None, prefix=True):
    config = SchedulerConfig(max_len or min(64, num_blocks * BLOCK), max_seqs, budget, prefix)
    swap = BlockPool(swap_blocks, BLOCK) if swap_blocks else None
    return Scheduler(config, BlockPool(num_blocks, BLOCK), reclaimer or DefaultReclaimer(), swap)


def request(i, prompt, max_tokens=8, arrival=None):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return Request(str(i), i if arrival is None else arrival, prompt, params)


def run(sched, runner, limit=1000):
    """Step until every request is finished; return the scheduler outputs."""
    outs = []
    while sched.has_unfinished():
        out = sched.schedule()
        assert not out.is_empty, f"nothing scheduled while requests wait: {sched.waiting}"
        sched.update(out, runner.execute(out))
        outs.append(out)
        assert len(outs) < limit
    return outs


def assert_pool_empty(sched):
    for pool in (sched.pool, sched.swap_pool):
        if pool is not None:
            pool.check_invariants()
            assert pool.num_free == pool.num_blocks, "a block is still held after every request ended"


def test_continuous_batching_admits_while_others_decode():
    sched, runner = make(), FakeRunner(BLOCK)
    a = request(0, [1, 2, 3, 4, 5], max_tokens=6)
    sched.add(a)
    first = sched.schedule()
    sched.update(first, runner.execute(first))
    b = request(1, [9, 8, 7], max_tokens=3)
    sched.add(b)
    second = sched.schedule()
    assert second.seqs == [a, b] and second.num_new_tokens == [1, 3]  # a decodes, b prefills, one step
    sched.update(second, runner.execute(second))
    run(sched, runner)
    assert a.output_token_ids == expected_output([1, 2, 3, 4, 5], 6)
    assert b.output_token_ids == expected_output([9, 8, 7], 3)
    assert a.finish_reason == b.finish_reason == "length"
    assert_pool_empty(sched)


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    sched, runner = make(budget=4), FakeRunner(BLOCK)
    prompt = list(range(1, 11))
    seq = request(0, prompt, max_tokens=2)
    sched.add(seq)
    outs = run(sched, runner)
    assert [o.num_new_tokens for o in outs] == [[4], [4], [2], [1]]
    assert [bool(runner.steps[i].sample_rows) for i in range(4)] == [False, False, True, True]
    assert seq.output_token_ids == expected_output(prompt, 2)


def test_budget_goes_to_running_requests_first():
    sched, runner = make(budget=6), FakeRunner(BLOCK)
    sched.add(request(0, [1, 2, 3]))
    out = sched.schedule()
    sched.update(out, runner.execute(out))
    sched.add(request(1, list(range(20, 40))))
    out = sched.schedule()
    assert out.num_new_tokens == [1, 5]  # the decode first, the new prompt's first chunk takes the rest


def test_prefix_cache_hits_full_blocks_but_never_the_last_token():
    sched, runner = make(), FakeRunner(BLOCK)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    a = request(0, [*shared, 1, 2], max_tokens=2)
    sched.add(a)
    run(sched, runner)
    hits_before = sched.pool.stats().hits
    b = request(1, [*shared, 3], max_tokens=2)
    c = request(2, shared, max_tokens=2)  # exactly two full blocks: the second is computed again
    sched.add(b)
    sched.add(c)
    out = sched.schedule()
    assert out.num_new_tokens == [1, 4]
    assert sched.pool.stats().hits - hits_before == 3
    sched.update(out, runner.execute(out))
    run(sched, runner)
    assert b.output_token_ids == expected_output([*shared, 3], 2)
    assert c.output_token_ids == expected_output(shared, 2)
    assert_pool_empty(sched)


def test_prefix_caching_off_computes_everything():
    sched, runner = make(prefix=False), FakeRunner(BLOCK)
    for i in range(2):
        sched.add(request(i, [5, 6, 7, 8, 9, 10, 11, 12, 13], max_tokens=1))
        out = sched.schedule()
        assert out.num_new_tokens == [9]
        sched.update(out, runner.execute(out))
    assert sched.pool.stats().hits == 0


def test_preemption_by_recompute_takes_the_latest_arrival_and_resumes_it():
    sched, runner = make(num_blocks=6, budget=32), FakeRunner(BLOCK)
    prompts = [[i + 1] * 6 for i in range(3)]
    seqs = [request(i, p, max_tokens=8) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    outs = run(sched, runner)
    preempted = [s.request_id for o in outs for s in o.preempted]
    assert preempted and set(preempted) <= {"1", "2"}  # the earliest request keeps its blocks
    assert seqs[0].num_preemptions == 0
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_token_ids == expected_output(p, 8)
    assert_pool_empty(sched)


def test_preemption_by_swap_moves_blocks_out_and_back():
    sched = make(num_blocks=6, swap_blocks=8, budget=32, reclaimer=DefaultReclaimer(swap_min_tokens=0))
    runner = FakeRunner(BLOCK)
    prompts = [[i + 1] * 6 for i in range(3)]
    seqs = [request(i, p, max_tokens=8) for i, p in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    outs = run(sched, runner)
    assert any(o.swap_out for o in outs) and any(o.swap_in for o in outs)
    swapped = [s for o in outs for s in o.preempted]
    assert all(s.num_computed_tokens > 0 for s in swapped)  # nothing recomputed
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_token_ids == expected_output(p, 8)
    assert_pool_empty(sched)


def test_no_admission_in_a_step_that_preempted():
    sched, runner = make(num_blocks=4, budget=32), FakeRunner(BLOCK)
    for i in range(2):
        sched.add(request(i, [i + 1] * 7, max_tokens=8))
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            assert all(s.status is RequestStatus.RUNNING for s in out.seqs)
            assert not set(out.seqs) - set(sched.running)
            break
        sched.update(out, runner.execute(out))
    else:
        pytest.fail("no preemption happened")


def test_finish_and_abort_give_every_block_back():
    sched, runner = make(num_blocks=8, swap_blocks=8, reclaimer=DefaultReclaimer(swap_min_tokens=0)), FakeRunner(BLOCK)
    seqs = [request(i, [i + 3] * 9, max_tokens=20) for i in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(6):
        out = sched.schedule()
        sched.update(out, runner.execute(out))
    for s in seqs:
        sched.finish(s, "abort")
    assert all(s.finish_reason == "abort" for s in seqs)
    assert not sched.has_unfinished()
    assert_pool_empty(sched)


def test_stop_tokens_and_max_model_len_finish_requests():
    sched, runner = make(max_len=12), FakeRunner(BLOCK)
    prompt = [1, 2, 3]
    stop = expected_output(prompt, 3)[2]
    a = Request("0", 0, prompt, SamplingParams(temperature=0, max_tokens=50), stop_token_ids=[stop])
    b = request(1, [7] * 10, max_tokens=50)
    sched.add(a)
    sched.add(b)
    run(sched, runner)
    assert a.finish_reason == "stop" and a.output_token_ids == expected_output(prompt, 3)
    assert b.finish_reason == "length" and b.num_tokens == 12


class _StopAt:
    """A stop matcher that finds a "stop string" once it has seen ``token``, and records what it was fed."""

    def __init__(self, token):
        self.token, self.fed = token, []

    def feed(self, token_id):
        self.fed.append(token_id)
        return self.token in self.fed


def test_update_decides_every_stop_in_one_place_and_feeds_the_matcher_each_token():
    sched, runner = make(max_len=16), FakeRunner(BLOCK)
    prompt = [1, 2, 3]
    out = expected_output(prompt, 6)
    params = SamplingParams(temperature=0, max_tokens=6)
    by_text = Request("0", 0, prompt, params, stop_matcher=_StopAt(out[2]))
    token_first = Request("1", 1, prompt, params, stop_token_ids=[out[3]], stop_matcher=_StopAt(out[3]))
    # the last token max_tokens allows also completes the stop string: a stop, as vLLM reports it (the text is cut)
    text_at_length = Request("2", 2, prompt, params, stop_matcher=_StopAt(out[5]))
    length = Request("3", 3, prompt, params, stop_matcher=_StopAt(-1))  # a stop string that never appears
    for seq in (by_text, token_first, text_at_length, length):
        sched.add(seq)
    run(sched, runner)
    assert by_text.finish_reason == "stop" and by_text.output_token_ids == out[:3]
    assert token_first.finish_reason == "stop" and token_first.output_token_ids == out[:4]
    assert text_at_length.finish_reason == "stop" and text_at_length.output_token_ids == out
    assert length.finish_reason == "length" and length.output_token_ids == out
    for seq in (by_text, token_first, text_at_length, length):  # every output token, the one that ended it included
        assert seq.stop_matcher.fed == seq.output_token_ids
    assert_pool_empty(sched)


class _Recording(DefaultReclaimer):
    def __init__(self):
        super().__init__(swap_min_tokens=0)
        self.pressures = []

    def plan(self, pressure):
        self.pressures.append(pressure)
        return super().plan(pressure)


def test_reclaimer_sees_cached_blocks_first_and_requests_only_when_they_cannot_cover():
    reclaimer = _Recording()
    sched, runner = make(num_blocks=6, reclaimer=reclaimer), FakeRunner(BLOCK)
    sched.add(request(0, [1] * 8, max_tokens=1))
    run(sched, runner)  # two cached blocks remain
    sched.add(request(1, [2] * 20, max_tokens=1))
    run(sched, runner)
    first = reclaimer.pressures[0]
    assert first.need == 5 and first.free == 4 and len(first.cached) == 2 and first.candidates == ()


class _EvictNewest(DefaultReclaimer):
    """Evicts the most recently used cached blocks (the pool's order reversed): not what allocate would take."""

    def __init__(self):
        super().__init__()
        self.pressures = []

    def plan(self, pressure):
        self.pressures.append(pressure)
        return ReclaimPlan(evict=pressure.cached[::-1][: pressure.need - pressure.free])


class _NewestFirstPool(BlockPool):
    """A plugin's pool whose eviction order is its own (most recently freed first)."""

    def cached_blocks(self):
        return super().cached_blocks()[::-1]


@pytest.mark.parametrize("pool_class", [BlockPool, _NewestFirstPool])
def test_the_scheduler_asks_the_pool_which_blocks_are_cached_and_evicts_through_it(pool_class):
    reclaimer = _EvictNewest()
    pool = pool_class(6, BLOCK)
    sched, runner = Scheduler(SchedulerConfig(24, 8, 64), pool, reclaimer), FakeRunner(BLOCK)
    assert not hasattr(sched, "_cached")  # no books of its own
    first_blocks = []
    for i in range(2):  # one after the other: each leaves one full block cached
        seq = request(i, [i + 1] * 5, max_tokens=1)
        sched.add(seq)
        out = sched.schedule()
        first_blocks.append(seq.block_table[0])
        sched.update(out, runner.execute(out))
    cached = pool.cached_blocks()
    assert sorted(cached) == sorted(first_blocks)
    late = request(2, [9] * 17, max_tokens=1)  # 5 blocks: the 4 plain ones and 1 cached
    sched.add(late)
    run(sched, runner)
    (pressure,) = reclaimer.pressures
    assert pressure.cached == cached and pressure.free == 4  # the pool's answer, in the pool's order
    evicted = first_blocks.index(cached[-1])  # the reclaimer's choice, not what allocate would evict
    kept = 1 - evicted
    assert pool.lookup(pool.hash_block(None, [evicted + 1] * BLOCK)) is None
    assert pool.lookup(pool.hash_block(None, [kept + 1] * BLOCK)) == first_blocks[kept]
    pool.free([first_blocks[kept]])
    assert pool.stats().evictions == 1 and late.output_token_ids == expected_output([9] * 17, 1)
    assert_pool_empty(sched)


@pytest.mark.parametrize(
    ("bad_plan", "message"),
    [
        (ReclaimPlan(evict=(0,)), "not cached-free"),
        (ReclaimPlan(preempt=(Preemption("nobody", "recompute"),)), "not candidates"),
        (ReclaimPlan(preempt=(Preemption("1", "teleport"),)), "modes are swap, recompute"),
        (ReclaimPlan(), "must free enough when it can"),
        ("evict everything", "must return a vllm_port.reclaimer.ReclaimPlan"),
    ],
)
def test_a_plan_that_breaks_the_rules_is_refused_naming_the_reclaimer(bad_plan, message):
    class Broken:
        def plan(self, pressure):
            return bad_plan

    sched, runner = make(num_blocks=4, budget=32, reclaimer=Broken()), FakeRunner(BLOCK)
    sched.reclaimer_name = "plugin 'broken'"
    for i in range(2):
        sched.add(request(i, [i + 1] * 7, max_tokens=8))
    with pytest.raises(MemoryContractError, match=rf"plugin 'broken'.*{message}"):
        run(sched, runner)


def test_max_model_len_beyond_the_pool_is_refused():
    with pytest.raises(MemoryContractError, match="exceeds the KV cache's 16 tokens"):
        make(num_blocks=4, max_len=17)


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 12)), min_size=1, max_size=7),
    num_blocks=st.integers(9, 24),
    budget=st.integers(1, 24),
    shared=st.integers(0, 9),
    late=st.integers(0, 6),
)
def test_any_workload_finishes_correctly_and_fairly(swap, lengths, num_blocks, budget, shared, late):
    """Random prompts (sharing a prefix), pool sizes and budgets; some requests arrive mid-run.

    Every output equals the fake model's on the request alone, the first arrival is never
    preempted, and no block is left behind.
    """
    reclaimer = DefaultReclaimer(swap_min_tokens=4)
    sched = make(num_blocks=num_blocks, swap_blocks=12 if swap else 0, budget=budget, max_len=36, reclaimer=reclaimer)
    runner = FakeRunner(BLOCK)
    prefix = [3] * shared
    seqs = [request(i, (prefix + [i % VOCAB] * n)[:30], max_tokens=m) for i, (n, m) in enumerate(lengths)]
    for s in seqs[: len(seqs) - late // 2]:
        sched.add(s)
    pending = seqs[len(seqs) - late // 2 :]
    steps = 0
    while sched.has_unfinished() or pending:
        if pending and steps % 3 == 2:
            sched.add(pending.pop(0))
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        steps += 1
        assert steps < 2000
    assert seqs[0].num_preemptions == 0
    for s in seqs:
        want = expected_output(s.prompt_token_ids, s.params.max_tokens)
        cut = 36 - s.num_prompt_tokens
        assert s.output_token_ids == want[:cut], s
    assert_pool_empty(sched)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize(
    "module", ["engine/scheduler.py", "engine/request.py", "engine/sampling_params.py", "reclaimer.py"]
)
def test_scheduling_modules_are_device_free(module):
    # the floors of the design: the scheduler and what it reads never import torch, directly or
    # through a module of the package that does
    device_free = {"..errors", "..reclaimer", ".request", ".sampling_params", ".errors", "..kv_pool"}
    path = Path(vllm_port.__file__).parent / module
    imports = _imports(path)
    assert not {n for n in imports if n.split(".")[0] == "torch"}, imports
    assert {n for n in imports if n.startswith(".")} <= device_free, imports
