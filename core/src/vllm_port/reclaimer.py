"""The reclaimer: the memory policy that decides what gives way when the KV-cache pool runs short.

It is the third memory part beside the allocator and the migrator (contract hook
``vllm_port_reclaimer``), device-free like the block pool. The scheduler asks it whenever a request
needs more blocks than the pool has plainly free, describing the situation as facts
(:class:`MemoryPressure`: the blocks needed, those free, the cached-free blocks that still hold a
prefix, the running requests that could give way, the room left in swap space); the reclaimer
answers with a :class:`ReclaimPlan` (cached blocks to evict, requests to preempt, each by swap or by
recompute), and the scheduler carries it out. A reclaimer never touches the pool or a request.

Rules every plan must follow (:func:`check_plan`; the conformance check holds every plugin to them):

- it evicts only blocks of ``pressure.cached`` (cached-free blocks: no request uses them), each once;
- it preempts only requests of ``pressure.candidates``, each once, by a mode of :data:`PREEMPT_MODES`;
- it swaps only what swap space holds: the blocks of the requests it swaps add up to at most ``swap_free``;
- it frees enough when it can: if evicting every cached block and preempting every candidate would
  cover ``need``, the plan covers it (:func:`plan_frees`).

A plan may do more than needed (evicting a prefix nobody will hit again is never wrong), and
preempting the requester itself is allowed (it then waits, and nobody else gives way for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .errors import MemoryContractError

__all__ = [
    "PREEMPT_MODES",
    "DefaultReclaimer",
    "MemoryPressure",
    "Preemption",
    "ReclaimPlan",
    "Reclaimer",
    "RequestFacts",
    "check_plan",
    "plan_frees",
    "reclaimable",
]

#: How a preempted request gives its blocks back: copied to swap space and copied back when it
#: resumes (``"swap"``), or dropped and computed again from its tokens (``"recompute"``).
PREEMPT_MODES = ("swap", "recompute")


@dataclass(frozen=True)
class RequestFacts:
    """A running request that could be preempted, as the reclaimer sees it.

    Attributes:
        request_id: the request's id (unique among the candidates).
        arrival: its place in arrival order (lower came first): first come, first served.
        num_blocks: blocks in its block table (what a swap copies and swap space must hold).
        num_freed: blocks that return to the pool if it is preempted (those no other request shares).
        num_computed_tokens: tokens whose keys and values are cached: what a recompute runs again.
    """

    request_id: str
    arrival: int
    num_blocks: int
    num_freed: int
    num_computed_tokens: int


@dataclass(frozen=True)
class MemoryPressure:
    """The facts of one shortage of blocks.

    Attributes:
        need: blocks the requester needs now.
        free: blocks plainly free now (fewer than ``need``, or the reclaimer would not be asked).
        cached: cached-free blocks (no request holds them; a prefix lookup can still hit them),
            least recently used first. Evicting one makes it plainly free.
        candidates: running requests that may be preempted, in arrival order; the requester is
            among them when it already holds blocks (``requester``), and there are none when the
            requester is a new request being admitted (new requests never push running ones out).
        requester: the id of the request that needs the blocks.
        swap_free: blocks free in swap space (0 when the platform has no swap tier or none was configured).
    """

    need: int
    free: int
    cached: tuple[int, ...]
    candidates: tuple[RequestFacts, ...]
    requester: str
    swap_free: int


@dataclass(frozen=True)
class Preemption:
    """Preempt request ``request_id`` by ``mode`` (one of :data:`PREEMPT_MODES`)."""

    request_id: str
    mode: str


@dataclass(frozen=True)
class ReclaimPlan:
    """A reclaimer's answer: cached blocks to evict, then requests to preempt, in this order."""

    evict: tuple[int, ...] = ()
    preempt: tuple[Preemption, ...] = ()


@runtime_checkable
class Reclaimer(Protocol):
    """The memory policy under pressure; see the module docstring for the rules of a plan."""

    def plan(self, pressure: MemoryPressure) -> ReclaimPlan:
        """Decide what gives way so that ``pressure.need`` blocks can be allocated."""
        ...


def plan_frees(pressure: MemoryPressure, plan: ReclaimPlan) -> int:
    """Blocks available after ``plan``: the plainly free ones, the evicted ones and those preemption frees."""
    by_id = {c.request_id: c for c in pressure.candidates}
    return pressure.free + len(plan.evict) + sum(by_id[p.request_id].num_freed for p in plan.preempt)


def reclaimable(pressure: MemoryPressure) -> int:
    """The most blocks any plan could make available: every cached block evicted, every candidate preempted."""
    return pressure.free + len(pressure.cached) + sum(c.num_freed for c in pressure.candidates)


def check_plan(pressure: MemoryPressure, plan: object, who: str = "reclaimer") -> ReclaimPlan:
    """``plan`` if it follows the rules of the module docstring, else a :class:`MemoryContractError` naming ``who``.

    :return: the plan, typed.
    """
    if not isinstance(plan, ReclaimPlan):
        raise MemoryContractError(f"{who}: plan() returned {plan!r}; it must return a vllm_port.reclaimer.ReclaimPlan")
    cached = set(pressure.cached)
    evict = list(plan.evict)
    strangers = [b for b in evict if b not in cached]
    if strangers:
        raise MemoryContractError(
            f"{who}: the plan evicts block(s) {strangers}, which are not cached-free (cached-free now: "
            f"{sorted(cached)}); only blocks no request uses may be evicted"
        )
    if len(set(evict)) != len(evict):
        raise MemoryContractError(f"{who}: the plan evicts a block twice: {evict}")
    by_id = {c.request_id: c for c in pressure.candidates}
    named = [p.request_id for p in plan.preempt if isinstance(p, Preemption)]
    if len(named) != len(plan.preempt):
        raise MemoryContractError(f"{who}: plan.preempt holds {list(plan.preempt)!r}; each entry must be a Preemption")
    unknown = [r for r in named if r not in by_id]
    if unknown:
        raise MemoryContractError(
            f"{who}: the plan preempts request(s) {unknown}, which are not candidates (candidates: {sorted(by_id)})"
        )
    if len(set(named)) != len(named):
        raise MemoryContractError(f"{who}: the plan preempts a request twice: {named}")
    bad_modes = [(p.request_id, p.mode) for p in plan.preempt if p.mode not in PREEMPT_MODES]
    if bad_modes:
        raise MemoryContractError(
            f"{who}: preemption mode(s) {bad_modes} unknown; modes are {', '.join(PREEMPT_MODES)}"
        )
    swapped = sum(by_id[p.request_id].num_blocks for p in plan.preempt if p.mode == "swap")
    if swapped > pressure.swap_free:
        raise MemoryContractError(
            f"{who}: the plan swaps out {swapped} blocks, but swap space has {pressure.swap_free} free; "
            "recompute the requests that do not fit"
        )
    if plan_frees(pressure, plan) < pressure.need <= reclaimable(pressure):
        raise MemoryContractError(
            f"{who}: the plan leaves {plan_frees(pressure, plan)} blocks for a need of {pressure.need}, "
            f"though {reclaimable(pressure)} could be reclaimed; a plan must free enough when it can"
        )
    return plan


class DefaultReclaimer:
    """Core's policy: evict cached prefixes least recently used first, then preempt the latest arrivals.

    Cached blocks go first because no running request loses work by it. Requests are preempted
    from the most recent arrival backwards, so the earliest request always keeps its blocks and
    finishes (no starvation under first come, first served). A preempted request is swapped when
    swap space holds it and it has at least ``swap_min_tokens`` tokens cached (copying a short
    context out and back costs more than computing it again); otherwise it is recomputed.
    """

    def __init__(self, swap_min_tokens: int = 128) -> None:
        if not isinstance(swap_min_tokens, int) or swap_min_tokens < 0:
            raise MemoryContractError(f"DefaultReclaimer: swap_min_tokens must be an int >= 0, got {swap_min_tokens!r}")
        self.swap_min_tokens = swap_min_tokens

    def plan(self, pressure: MemoryPressure) -> ReclaimPlan:
        """Evict the fewest least-recently-used cached blocks, then preempt latest arrivals, until ``need`` is met.

        When even that cannot meet it, nothing gives way in vain: the plan is empty and the requester waits.
        """
        if reclaimable(pressure) < pressure.need:
            return ReclaimPlan()
        short = pressure.need - pressure.free
        evict = tuple(pressure.cached[: max(short, 0)])
        short -= len(evict)
        preempt: list[Preemption] = []
        swap_free = pressure.swap_free
        for facts in sorted(pressure.candidates, key=lambda c: c.arrival, reverse=True):
            if short <= 0:
                break
            swap = facts.num_blocks <= swap_free and facts.num_computed_tokens >= self.swap_min_tokens
            swap_free -= facts.num_blocks if swap else 0
            preempt.append(Preemption(facts.request_id, "swap" if swap else "recompute"))
            short -= facts.num_freed
        return ReclaimPlan(evict, tuple(preempt))
