"""Memory contract, the reclaimer: every plan it makes is one the scheduler may carry out.

The plugin's reclaimer (``Runtime.reclaimer()``: its own, or core's default when it brings none)
is shown generated shortages of blocks (hypothesis, derandomized) and must answer each with a plan
that evicts only cached-free blocks (never a block a request uses), preempts only candidate
requests by a known mode, swaps no more than swap space holds, and frees enough blocks whenever
evicting and preempting everything would (:func:`vllm_port.reclaimer.check_plan`).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_port.errors import MemoryContractError
from vllm_port.reclaimer import MemoryPressure, RequestFacts, check_plan, plan_frees, reclaimable

EXAMPLES = 200


@st.composite
def pressures(draw: st.DrawFn, with_candidates: bool = True) -> MemoryPressure:
    """A shortage: plainly free blocks below the need, some cached blocks, some running requests."""
    num_blocks = draw(st.integers(4, 512))
    free = draw(st.integers(0, min(16, num_blocks)))
    rng = draw(st.randoms(use_true_random=False))
    cached = tuple(rng.sample(range(num_blocks), draw(st.integers(0, min(64, num_blocks - free)))))
    candidates = []
    for i in range(draw(st.integers(0, 8)) if with_candidates else 0):
        held = draw(st.integers(1, 64))
        computed = draw(st.integers(0, held * 16))
        candidates.append(
            RequestFacts(f"req-{i}", draw(st.integers(0, 1000)), held, draw(st.integers(0, held)), computed)
        )
    requester = candidates[0].request_id if candidates and draw(st.booleans()) else "new-request"
    need = draw(st.integers(free + 1, free + 1 + len(cached) + sum(c.num_freed for c in candidates) + 4))
    return MemoryPressure(need, free, cached, tuple(candidates), requester, draw(st.integers(0, 256)))


def _who(runtime) -> str:
    name = type(runtime.reclaimer()).__name__
    return f"plugin {runtime.selected.name!r}: reclaimer {name} (from plugin {runtime.reclaimer_plugin!r})"


_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(pressure=pressures())
def test_reclaimer_plans_follow_the_contract(plugin, pressure):
    runtime = plugin.runtime()
    try:
        check_plan(pressure, runtime.reclaimer().plan(pressure), _who(runtime))
    except MemoryContractError as exc:
        pytest.fail(f"{exc}\npressure: {pressure}")


@_SETTINGS
@given(pressure=pressures())
def test_reclaimer_never_evicts_a_block_in_use(plugin, pressure):
    runtime = plugin.runtime()
    plan = runtime.reclaimer().plan(pressure)
    in_use = [b for b in getattr(plan, "evict", ()) if b not in pressure.cached]
    assert not in_use, f"{_who(runtime)} evicts block(s) {in_use} that are not cached-free; pressure: {pressure}"


@_SETTINGS
@given(pressure=pressures(with_candidates=False))
def test_reclaimer_evicts_enough_cached_blocks_for_a_new_request(plugin, pressure):
    # a request being admitted offers no candidates: only cached blocks can give way, and must when they suffice
    runtime = plugin.runtime()
    plan = check_plan(pressure, runtime.reclaimer().plan(pressure), _who(runtime))
    assert not plan.preempt
    if reclaimable(pressure) >= pressure.need:
        assert plan_frees(pressure, plan) >= pressure.need


def test_reclaimer_is_one_object_per_runtime(plugin):
    runtime = plugin.runtime()
    assert runtime.reclaimer() is runtime.reclaimer(), f"{_who(runtime)}: the runtime must keep one reclaimer"
    assert callable(getattr(runtime.reclaimer(), "plan", None))
