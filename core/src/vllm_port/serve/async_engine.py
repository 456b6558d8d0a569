"""The async front end: requests arrive on an asyncio loop, one engine thread steps the batch, deltas stream back.

::

    engine = AsyncEngine(llm, max_waiting=64)
    engine.start()                                    # on the running asyncio loop
    group = await engine.submit(["The sea"], SamplingParams(max_tokens=8))
    async for prompt_index, delta in group:           # StreamOutput deltas as the engine makes them
        ...
    await group.aclose()                              # before the end: aborts, the blocks go back at once

The engine thread owns the :class:`~vllm_port.engine.LLM`: it alone calls ``add_request``, ``step``
and ``abort_request``. The front end hands it commands through an inbox under a condition
variable, which the thread waits on while there is no work (it never spins); each step's deltas
come back to the loop in one ``call_soon_threadsafe`` and go to their requests' queues. A request
counts against ``max_num_seqs + max_waiting`` from its submission to its end; past that,
:meth:`AsyncEngine.submit` raises :class:`EngineFullError` (the server answers 503 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.llm import LLM, AddedRequest, StreamOutput
from ..engine.sampling_params import SamplingParams
from .metrics import ServerMetrics

__all__ = ["AsyncEngine", "EngineFullError", "RequestGroup", "RequestRefusedError"]


class EngineFullError(Exception):
    """Too many requests running and waiting: come back in ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestRefusedError(ValueError):
    """The engine refused a prompt (empty, past ``max_model_len``, ids outside the vocabulary)."""

    def __init__(self, message: str, prompt_index: int) -> None:
        super().__init__(message)
        self.prompt_index = prompt_index


@dataclass
class RequestGroup:
    """The engine requests of one API call (one per prompt, each with its ``n`` samples), streamed as one.

    Iterating yields ``(prompt_index, delta)`` until every sample of every prompt has finished;
    :meth:`aclose` aborts what is unfinished (a client that went away) and is idempotent.

    Attributes:
        request_ids: the engine's id of each prompt's request.
        prompt_token_ids: each prompt as token ids.
        arrival: when the call arrived (``time.monotonic()``), for the latency metrics.
    """

    request_ids: list[str]
    prompt_token_ids: list[list[int]]
    samples: int
    arrival: float
    _engine: AsyncEngine = field(repr=False)
    _queue: asyncio.Queue[StreamOutput] = field(repr=False)
    _finished: int = 0
    _closed: bool = False
    _last_token_at: dict[tuple[str, int], float] = field(default_factory=dict, repr=False)

    def __aiter__(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        return self._deltas()

    @property
    def done(self) -> bool:
        """Whether every sample of every prompt has had its last delta."""
        return self._finished >= len(self.request_ids) * self.samples

    async def _deltas(self) -> AsyncIterator[tuple[int, StreamOutput]]:
        index = {request_id: i for i, request_id in enumerate(self.request_ids)}
        while not self.done:
            delta = await self._queue.get()
            self._observe(delta)
            yield index[delta.request_id], delta

    def _observe(self, delta: StreamOutput) -> None:
        metrics, now = self._engine.metrics, time.monotonic()
        key = (delta.request_id, getattr(delta, "sample_index", 0))
        if delta.token_ids:
            metrics.generation_tokens.inc(len(delta.token_ids))
            last = self._last_token_at.get(key)
            if last is None:
                metrics.time_to_first_token.observe(now - self.arrival)
            else:
                metrics.inter_token_latency.observe(now - last)
            self._last_token_at[key] = now
        if delta.finish_reason is not None:
            self._finished += 1
            if delta.finish_reason in ("stop", "length"):
                metrics.e2e_request_latency.observe(now - self.arrival)
            if self.done:
                self._release()

    async def aclose(self) -> None:
        """Abort every unfinished request of the group (their KV blocks go back to the pool at once)."""
        if not self.done:
            for request_id in self.request_ids:
                self._engine._post(lambda r=request_id: self._engine._abort(r))
        self._release()

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._in_flight -= len(self.request_ids) * self.samples


class AsyncEngine:
    """An :class:`~vllm_port.engine.LLM` stepped by its own thread, fed and read from an asyncio loop.

    :param llm: the engine; from :meth:`start` on only the engine thread touches it.
    :param max_waiting: requests (samples) that may wait beyond the ``max_num_seqs`` running ones.
    :param metrics: where the engine's state and the latencies go (a fresh :class:`ServerMetrics` by default).
    """

    def __init__(self, llm: LLM, max_waiting: int, metrics: ServerMetrics | None = None) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting is {max_waiting}; it must be 0 or more")
        self.llm = llm
        self.metrics = metrics or ServerMetrics()
        self.capacity = llm.engine_config.max_num_seqs + max_waiting
        self._in_flight = 0  # samples submitted and not finished; the loop's thread alone changes it
        self._inbox: deque[Callable[[], None]] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        # the engine thread's: each unfinished request's queue, and how many of its samples have not finished
        self._queues: dict[str, asyncio.Queue[StreamOutput]] = {}
        self._unfinished_samples: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the engine thread, if anything did

    # --- the front end (the asyncio loop's thread) -----------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call on the asyncio loop that will submit requests."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="vllm-port-engine", daemon=True)
        self._thread.start()
        self._post(self._publish_state)

    def stop(self) -> None:
        """Stop the engine thread (requests still running are dropped) and wait for it."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs (``/health``)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Samples submitted and not yet finished (running and waiting)."""
        return self._in_flight

    async def submit(
        self, prompts: Sequence[str | list[int]], params: SamplingParams, samples: int = 1
    ) -> RequestGroup:
        """Queue one engine request per prompt; return their group to stream from.

        :param samples: the samples each request yields (``params.n``, when the engine has it).
        :raises EngineFullError: when the running and waiting requests would pass the capacity.
        :raises RequestRefusedError: when the engine refuses a prompt (the others are then aborted).
        :raises ValueError: for sampling parameters the engine refuses.
        """
        if not self.alive:
            raise RuntimeError(f"the engine thread is not running ({self.error!r})")
        wanted = len(prompts) * samples
        if self._in_flight + wanted > self.capacity:
            self.metrics.requests_rejected.inc()
            raise EngineFullError(
                f"the server is full: {self._in_flight} requests running or waiting, at most {self.capacity} "
                "(--max-num-seqs plus --max-waiting); retry later"
            )
        self._in_flight += wanted
        arrival = time.monotonic()
        queue: asyncio.Queue[StreamOutput] = asyncio.Queue()
        added: list[AddedRequest] = []
        try:
            for prompt in prompts:
                added.append(await self._call(lambda p=prompt: self._add(p, params, samples, queue)))
        except BaseException:
            self._in_flight -= wanted
            for a in added:
                self._post(lambda r=a.request_id: self._abort(r))
            raise
        group = RequestGroup(
            [a.request_id for a in added], [a.prompt_token_ids for a in added], samples, arrival, self, queue
        )
        refused = next(((i, a) for i, a in enumerate(added) if a.error is not None), None)
        if refused is not None:
            await group.aclose()
            raise RequestRefusedError(str(refused[1].error), refused[0])
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in group.prompt_token_ids))
        return group

    async def _call(self, command: Callable[[], Any]) -> Any:
        """Run ``command`` on the engine thread; its result (or exception) comes back here."""
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()

        def run() -> None:
            try:
                result = command()
            except BaseException as exc:  # handed back to the caller, who raises it
                self._to_loop(_settle, future, None, exc)
            else:
                self._to_loop(_settle, future, result, None)

        self._post(run)
        return await future

    def _post(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    # --- the engine thread ---------------------------------------------------------------------

    def _add(
        self, prompt: str | list[int], params: SamplingParams, samples: int, queue: asyncio.Queue[StreamOutput]
    ) -> AddedRequest:
        added = self.llm.add_request(prompt, params)
        if added.error is None:
            self._queues[added.request_id] = queue
            self._unfinished_samples[added.request_id] = samples
        return added

    def _abort(self, request_id: str) -> None:
        self.llm.abort_request(request_id)
        self._publish_state()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self._stopping and not self.llm.has_unfinished_requests():
                        self._wake.wait()
                    if self._stopping:
                        return
                    commands = list(self._inbox)
                    self._inbox.clear()
                for command in commands:
                    command()
                if self.llm.has_unfinished_requests():
                    self._step()
        except BaseException as exc:
            self.error = exc
            raise

    def _step(self) -> None:
        try:
            deltas = self.llm.step()
        except Exception as exc:
            deltas = self._fail_all(exc)
        routed = [(self._queues[d.request_id], d) for d in deltas if d.request_id in self._queues]
        for delta in deltas:
            if delta.finish_reason is not None:
                self.metrics.request_success.labels(delta.finish_reason).inc()
            if delta.finish_reason is not None and delta.request_id in self._queues:
                self._unfinished_samples[delta.request_id] -= 1
                if not self._unfinished_samples[delta.request_id]:
                    del self._queues[delta.request_id], self._unfinished_samples[delta.request_id]
        self._publish_state()
        if routed:
            self._to_loop(_deliver, routed)

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """Run ``callback(*args)`` on the front end's loop; nothing once that loop has closed (shutting down)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to read the result
            pass

    def _fail_all(self, exc: Exception) -> list[StreamOutput]:
        """Abort every request after a failed step; each gets its last delta with the error."""
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        failed = []
        for request_id, samples in self._unfinished_samples.items():
            self.llm.abort_request(request_id)
            failed += [_error_delta(request_id, sample, message) for sample in range(samples)]
        try:
            self.llm.step()  # drains the aborted requests' deltas (nothing is left to schedule)
        except Exception:  # noqa: S110 - the requests have their error already
            pass
        return failed

    def _publish_state(self) -> None:
        scheduler, pool = self.llm.scheduler, self.llm.runner.pool
        self.metrics.set_engine_state(
            len(scheduler.running), len(scheduler.waiting), pool.num_free, pool.num_blocks, scheduler.num_preemptions
        )


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _error_delta(request_id: str, sample: int, message: str) -> StreamOutput:
    delta = StreamOutput(0, request_id, [], "", "error", message)
    if sample:
        delta.sample_index = sample  # type: ignore[attr-defined]  # the engine's n samples, once it has them
    return delta


def _deliver(routed: list[tuple[asyncio.Queue[StreamOutput], StreamOutput]]) -> None:
    for queue, delta in routed:
        queue.put_nowait(delta)
