"""The engine under load: thousands of requests against a KV pool far smaller than they need.

Two tiers, both through ``LLM``'s own request loop (``stream``, ``generate``, ``abort``):

- **thousands of requests, device-free**: the ``LLM`` of the tiny Llama with its runner replaced by
  :class:`CacheModel`, a model that *reads its context from the cache*: each sampled token is a
  hash of the tokens the cache slots of the sequence's block table hold. A prefix hit on the wrong
  block, a swap to the wrong place or a block reused too early changes the context it reads, so
  the request's output leaves the one it has alone (``alone_output``), and an empty slot read is
  an error at once. Preemption by swap and by recompute, prefix caching, chunked prefill, requests
  joining mid-run, aborts and bad requests all happen in the one run.
- **hundreds of requests, the real model**: the tiny Llama on the CPU plugin with a pool of a few
  blocks and swap space; greedy outputs equal those of one batched run with a pool that never runs
  short (which ``test_llm.py`` holds equal to each request run alone and to ``transformers``).

The numbers of the first (requests, lost, duplicated, leaked blocks, preemptions, peak memory) are
in ``docs/results/engine-load.md``; ``-s`` prints them.
"""

from __future__ import annotations

import gc
import random
import resource
import time
import tracemalloc
import weakref
from dataclasses import dataclass, field

import pytest
from llm_helpers import assert_pool_empty, make_llm, prompts
from plugin_factory import healthy

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.engine.scheduler import Scheduler, SchedulerConfig, StepBatch
from vllm_port.kv_pool import BlockPool
from vllm_port.reclaimer import DefaultReclaimer

FAKE_VOCAB = 97  # below the tiny model's 512, and holding its end-of-sequence ids 2 and 3
EOS = (2, 3)  # the tiny Llama's config.json
_ROOT = 0x5EED  # the key-value entry "before" position 0


def fake_kv(previous: int, token: int, position: int) -> int:
    """The device-free model's key-value entry of ``token`` at ``position`` after the entry ``previous``.

    Chained, like a real model's keys and values: an entry depends on every token before it, so a
    block holding the same tokens after another prefix holds other entries. (Python's hash of a
    tuple of ints is the same in every process.)
    """
    return hash((previous, token, position))


def fake_next_token(entries: list[int]) -> int:
    """The greedy token after a context whose key-value entries are ``entries`` (it attends to all)."""
    return hash(tuple(entries)) % FAKE_VOCAB


class CacheModel:
    """A device-free runner whose "model" computes key-value entries into its cache and attends to them there.

    It keeps the entry each device slot and swap slot holds and copies blocks for the step's swaps.
    For each token of the step it writes ``fake_kv`` of the entry at the position before, read
    back through the sequence's block table; each sampling sequence then reads all its entries
    through its block table and samples ``fake_next_token`` of them: a real model's data flow, with
    hashes for the layers. A wrong prefix hit, a swap to the wrong place or a block reused too
    early changes what is read, and so the output; reading a slot nothing was written to fails at
    once. It keeps nothing per request.
    """

    def __init__(self, block_size: int, num_blocks: int, num_swap_blocks: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.swap_slots: list[int | None] = [None] * (num_swap_blocks * block_size)
        self.num_steps = 0
        self.num_chunks = 0  # prompt chunks that did not reach the prompt's end (chunked prefill)

    def _copy(self, src: list[int | None], dst: list[int | None], pairs: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for a, b in pairs:
            dst[b * bs : (b + 1) * bs] = src[a * bs : (a + 1) * bs]

    def execute(self, batch: StepBatch) -> list[int]:
        self.num_steps += 1
        self._copy(self.slots, self.swap_slots, batch.swap_out)
        self._copy(self.swap_slots, self.slots, batch.swap_in)
        slots, bs = self.slots, self.block_size
        self.num_chunks += len(batch.query_lens) - len(batch.sample_rows)
        k = 0
        for table, n, q in zip(batch.block_tables, batch.seq_lens, batch.query_lens, strict=True):
            for p in range(n - q, n):
                previous = _ROOT if p == 0 else slots[table[(p - 1) // bs] * bs + (p - 1) % bs]
                assert previous is not None, f"position {p - 1} of a sequence was never written (table {table})"
                slots[batch.slot_mapping[k]] = fake_kv(previous, batch.input_ids[k], p)
                k += 1
        sampled = []
        for row in batch.sample_rows:
            n = batch.seq_lens[row]
            entries: list[int | None] = []
            for block in batch.block_tables[row][: -(-n // bs)]:
                entries += slots[block * bs : (block + 1) * bs]
            del entries[n:]
            assert None not in entries, f"row {row} attends to a slot nothing was written to: {entries}"
            sampled.append(fake_next_token(entries))  # type: ignore[arg-type]
        return sampled

    def close(self) -> None:
        pass


def alone_output(prompt: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """What the device-free model generates for ``prompt`` by itself (stops as the engine stops)."""
    if not prompt:
        return []  # a bad request: the engine refuses it
    stop = {*(params.stop_token_ids or []), *(() if params.ignore_eos else EOS)}
    tokens, entries = list(prompt), []
    for p, token in enumerate(prompt):
        entries.append(fake_kv(entries[-1] if p else _ROOT, token, p))
    while len(tokens) - len(prompt) < params.max_tokens and len(tokens) < max_model_len:
        tokens.append(fake_next_token(entries))
        entries.append(fake_kv(entries[-1], tokens[-1], len(tokens) - 1))
        if tokens[-1] in stop:
            break
    return tokens[len(prompt) :]


@dataclass(frozen=True)
class Pressure:
    """The engine's limits for a load run: a pool of a few requests' worth, a small swap space."""

    block_size: int = 4
    num_blocks: int = 48  # 192 tokens: about three requests' contexts at a time
    num_swap_blocks: int = 40
    max_model_len: int = 96
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 48  # most prompts are prefilled in chunks
    swap_min_tokens: int = 24  # longer contexts are swapped (while swap space holds them), shorter recomputed


def device_free_llm(model_dir, runtime, pressure: Pressure) -> LLM:
    """An ``LLM`` whose request loop runs as it is, over :class:`CacheModel` and a pool of ``pressure``'s size."""
    llm = make_llm(model_dir, runtime, enable_prefix_caching=True)
    llm.close()  # the real cache's memory goes back; the request loop is all this LLM keeps
    p = pressure
    config = SchedulerConfig(p.max_model_len, p.max_num_seqs, p.max_num_batched_tokens, enable_prefix_caching=True)
    llm.scheduler = Scheduler(
        config,
        BlockPool(p.num_blocks, p.block_size),
        DefaultReclaimer(swap_min_tokens=p.swap_min_tokens),
        BlockPool(p.num_swap_blocks, p.block_size),
    )
    llm.runner = CacheModel(p.block_size, p.num_blocks, p.num_swap_blocks)
    llm._finalizer = weakref.finalize(llm, lambda: None)  # open again, on a runner with nothing to give back
    llm.max_model_len = p.max_model_len
    return llm


@dataclass
class Workload:
    """Requests with random prompt and output lengths; many prompts share one of a few prefixes."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    bad: set[int] = field(default_factory=set)  # indices of requests that must get an error


def workload(n: int, max_model_len: int, seed: int, block_size: int = 4) -> Workload:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 512) for _ in range(rng.choice((8, 12, 20, 32)))] for _ in range(8)]
    # a few block-long phrases: the same block of tokens after many different prefixes, which only a
    # hash chained over the whole prefix tells apart
    phrases = [[rng.randrange(5, 512) for _ in range(block_size)] for _ in range(3)]
    out = Workload([], [])
    for i in range(n):
        length = rng.randint(1, max_model_len // 2 + 20)
        kind = rng.random()
        if kind < 0.5:  # shares a prefix (prefix-cache hits, and chained hashes over several blocks)
            prompt = (rng.choice(prefixes) + [rng.randrange(5, 512) for _ in range(length)])[:length]
        elif kind < 0.7:
            prompt = [t for _ in range(-(-length // block_size)) for t in rng.choice(phrases)][:length]
        else:
            prompt = [rng.randrange(5, 512) for _ in range(length)]
        if rng.random() < 0.01:  # bad requests: each must get an error and cost the others nothing
            out.bad.add(i)
            prompt = rng.choice([[], [7] * max_model_len, [5, 600, 6]])
        stop_ids = [rng.randrange(FAKE_VOCAB)] if rng.random() < 0.2 else None
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 40), ignore_eos=rng.random() < 0.5, stop_token_ids=stop_ids
        )
        out.prompts.append(prompt)
        out.params.append(params)
    return out


@dataclass
class Tally:
    """Everything streams yielded, per (call, request index)."""

    tokens: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    finals: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # finish reasons seen (must be one)
    errors: dict[tuple[int, int], str] = field(default_factory=dict)
    after_final: int = 0  # deltas of a request after its last one (must be 0)

    def add(self, call: int, delta) -> None:
        key = (call, delta.index)
        if key in self.finals:
            self.after_final += 1
        self.tokens.setdefault(key, []).extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finals.setdefault(key, []).append(delta.finish_reason)
            if delta.error:
                self.errors[key] = delta.error


@pytest.mark.slow
def test_thousands_of_requests_against_a_small_pool(llama_model, cpu_runtime):
    """3,000 requests in two calls (the second joins mid-run) plus one stream closed early.

    Every request ends exactly once (stop, length, an error for the bad ones, abort for those
    aborted); every output equals the request's output alone (a prefix of it when aborted);
    preemption by swap and by recompute both happen; no block is left; memory stays bounded.
    """
    pressure = Pressure()
    llm = device_free_llm(llama_model, cpu_runtime, pressure)
    first, second = workload(2000, pressure.max_model_len, seed=1), workload(1000, pressure.max_model_len, seed=2)
    closed = workload(200, pressure.max_model_len, seed=3)
    calls = [first, second, closed]
    want = [
        [alone_output(p, s, pressure.max_model_len) for p, s in zip(w.prompts, w.params, strict=True)] for w in calls
    ]
    abort_rng = random.Random(4)
    tally, aborted = Tally(), set()
    gc.collect()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    start = time.perf_counter()

    streams = {0: llm.stream(first.prompts, first.params)}
    deltas = closed_deltas = 0
    while streams:
        for call in list(streams):
            delta = next(streams[call], None)
            if delta is None:
                del streams[call]
                continue
            deltas += 1
            closed_deltas += call == 2
            tally.add(call, delta)
            if delta.finish_reason is None and abort_rng.random() < 0.002 and llm.abort(delta.request_id):
                aborted.add((call, delta.index))
        if deltas == 5000 and 1 not in streams:  # more requests arrive while the first ones run
            streams[1] = llm.stream(second.prompts, second.params)
        if deltas == 9000:  # a client opens a stream and walks away after a few tokens
            streams[2] = llm.stream(closed.prompts, closed.params)
        if 2 in streams and closed_deltas >= 30:
            streams.pop(2).close()

    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    gc.collect()
    retained, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before

    # nothing lost or duplicated: every request of the finished calls ends exactly once
    for call, w in enumerate(calls[:2]):
        for i in range(len(w.prompts)):
            assert len(tally.finals.get((call, i), [])) == 1, (call, i, tally.finals.get((call, i)))
    assert tally.after_final == 0
    lost = sum(1 for c, w in enumerate(calls[:2]) for i in range(len(w.prompts)) if (c, i) not in tally.finals)
    duplicated = sum(len(v) - 1 for v in tally.finals.values())
    # every output is the request's alone (a prefix of it when aborted); bad requests get an error
    reasons: dict[str, int] = {}
    for call, w in enumerate(calls[:2]):
        for i, expected in enumerate(want[call]):
            (reason,) = tally.finals[(call, i)]
            reasons[reason] = reasons.get(reason, 0) + 1
            got = tally.tokens[(call, i)]
            if i in w.bad:
                assert reason == "error" and got == [] and tally.errors[(call, i)], (call, i)
            elif (call, i) in aborted:
                assert reason == "abort" and got == expected[: len(got)] and len(got) < len(expected)
            else:
                assert got == expected, (call, i, reason)
                assert reason == ("stop" if expected[-1] in _stops(w.params[i]) else "length"), (call, i)
    # the closed stream's requests got no more than their prefix before it closed
    for (call, i), got in tally.tokens.items():
        if call == 2:
            assert got == want[2][i][: len(got)]
    assert aborted and reasons["abort"] == len(aborted) and reasons["error"] == len(first.bad) + len(second.bad)
    # preemption of both kinds happened, and every block is back
    sched = llm.scheduler
    assert sched.num_swapped > 0 and sched.num_preemptions - sched.num_swapped > 0
    assert sched.pool.stats().hits > 1000  # the shared prefixes were hit
    assert llm.runner.num_chunks > 1000  # prompts were prefilled in chunks
    assert not sched.has_unfinished() and not llm._live
    leaked = sched.pool.num_blocks - sched.pool.num_free + sched.swap_pool.num_blocks - sched.swap_pool.num_free
    assert_pool_empty(llm)
    # memory: the engine keeps nothing per finished request; the peak is the requests' own tokens
    assert peak < 48 << 20, f"peak traced memory {peak / 2**20:.1f} MiB"
    assert retained < 8 << 20, f"{retained / 2**20:.1f} MiB still allocated after the run"
    print(
        f"\nload: {sum(len(w.prompts) for w in calls)} requests ({len(calls[2].prompts)} in the closed stream), "
        f"lost {lost}, duplicated {duplicated}, leaked blocks {leaked}, finish reasons {reasons}, "
        f"preemptions {sched.num_preemptions} ({sched.num_swapped} swapped), prefix hits {sched.pool.stats().hits}, "
        f"prompt chunks {llm.runner.num_chunks}, steps {llm.runner.num_steps}, {seconds:.1f} s; traced peak {peak / 2**20:.1f} MiB, retained "
        f"{retained / 2**20:.2f} MiB, max RSS growth {rss_growth / 1024:.1f} MiB"
    )


def _stops(params: SamplingParams) -> set[int]:
    return {*(params.stop_token_ids or []), *(() if params.ignore_eos else EOS)}


# --- the real model ------------------------------------------------------------------------------

#: The CPU platform with a host tier, so the engine has swap space (the CPU plugin declares none).
SWAPPING_CPU = healthy(
    "loadcpu",
    priority=1,
    extra="""
import dataclasses
from vllm_port.reclaimer import DefaultReclaimer
from vllm_port_cpu import ops as cpu_ops

@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(
        name=PLATFORM, device_type="cpu", priority=PRIORITY, dist_backend="gloo", memory_tiers=("device", "host")
    )

@hookimpl
def vllm_port_providers():
    return [dataclasses.replace(p, name=p.name + "_loadcpu", platform="") for p in cpu_ops.PROVIDERS]

@hookimpl
def vllm_port_reclaimer(platform):
    return DefaultReclaimer(swap_min_tokens=12) if platform.name == PLATFORM else None
""",
)


@pytest.mark.slow
def test_hundreds_of_requests_on_the_real_model_match_a_roomy_run(install_plugin, llama_model):
    """240 requests on the tiny Llama with a pool of 24 blocks of 4 tokens and swap space for 16 more."""
    install_plugin("loadcpu", SWAPPING_CPU)
    runtime = vllm_port.load(plugins="cpu,loadcpu", device="loadcpu")
    rng = random.Random(5)
    shared = prompts([12], seed=6)[0]
    lengths = [rng.randint(1, 36) for _ in range(240)]
    batch = [(shared + p)[: len(p)] if rng.random() < 0.5 else p for p in prompts(lengths, seed=7)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True) for _ in batch]
    roomy = make_llm(llama_model, runtime, max_num_seqs=len(batch), max_num_batched_tokens=8192, swap_space=0)
    want = [o.outputs[0].token_ids for o in roomy.generate(batch, params)]
    assert roomy.scheduler.num_preemptions == 0
    roomy.close()

    llm = make_llm(
        llama_model,
        runtime,
        block_size=4,
        kv_cache_memory=24 * 4096,
        swap_space=16 * 4096,
        max_model_len=64,
        max_num_batched_tokens=24,
    )
    assert llm.scheduler.pool.num_blocks == 24 and llm.scheduler.swap_pool.num_blocks == 16
    outputs = llm.generate(batch, params)
    assert [o.outputs[0].token_ids for o in outputs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    sched = llm.scheduler
    assert sched.num_swapped > 0 and sched.num_preemptions > sched.num_swapped  # swapped and recomputed
    assert sched.pool.stats().hits > 0
    assert_pool_empty(llm)
    print(
        f"\nreal model: {len(batch)} requests, {sum(len(w) for w in want)} tokens as in the roomy run, preemptions "
        f"{sched.num_preemptions} ({sched.num_swapped} swapped), prefix hits {sched.pool.stats().hits}"
    )


def test_abort_and_closing_a_stream_free_the_blocks_mid_generation(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime, block_size=4, kv_cache_memory=24 * 4096, max_model_len=64)
    pool = llm.scheduler.pool
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    batch = prompts([9, 17, 5, 30], seed=8)
    want = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    stream = llm.stream(batch, params)
    first = next(stream)
    held = pool.num_blocks - pool.num_free
    assert held > 0
    assert llm.abort(first.request_id) and not llm.abort(first.request_id) and not llm.abort("no such request")
    assert pool.num_blocks - pool.num_free < held  # its blocks are back at once
    tokens = {i: [] for i in range(len(batch))}
    tokens[first.index] += first.token_ids
    reasons = {}
    for delta in stream:
        tokens[delta.index] += delta.token_ids
        if delta.finish_reason is not None:
            reasons[delta.index] = delta.finish_reason
    assert reasons == {i: "abort" if i == first.index else "length" for i in range(len(batch))}
    assert tokens[first.index] == want[first.index][:1]
    assert all(tokens[i] == want[i] for i in range(len(batch)) if i != first.index)
    assert_pool_empty(llm)
    # mid-generation, under pressure: close the stream; nothing stays behind, and the engine goes on
    stream = llm.stream(batch * 4, params)
    for _ in range(40):
        next(stream)
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.has_unfinished() and pool.num_free < pool.num_blocks
    stream.close()
    assert not llm.scheduler.has_unfinished() and not llm._live
    assert_pool_empty(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == want
    assert_pool_empty(llm)
