"""Run a function on N local ranks in fresh processes, each in the platform's process group.

For tests, the conformance suite and benchmarks: ranks are spawned with ``torch.multiprocessing``
on a free localhost port, join through :func:`vllm_port.comm.init_from_env`, and send their result
(or their traceback) back through a queue. A rank that hangs past ``deadline_s`` is killed.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .comm import init_from_env
from .errors import CommError
from .platform import PlatformDescription

__all__ = ["free_port", "run_ranks", "set_rank_environment"]


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def set_rank_environment(rank: int, world_size: int, port: int) -> None:
    """Name this process rank ``rank`` of ``world_size`` on this host, its group met at localhost ``port``.

    The variables :func:`vllm_port.comm.init_from_env` reads (``RANK`` ... ``MASTER_PORT``), as a
    launcher such as torchrun sets them; for the ranks that :func:`run_ranks` and the engine's
    tensor-parallel workers spawn.
    """
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _worker(
    rank: int,
    world: int,
    port: int,
    desc: PlatformDescription,
    device_count: int | None,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    received: Any,
    deadline_s: float,
) -> None:
    set_rank_environment(rank, world, port)
    try:
        ctx = init_from_env(desc, timeout_s, device_count)
        results.put((rank, True, fn(ctx, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # A tensor in the result travels as a handle to this process's shared memory, which the parent
    # opens while unpickling it: exiting before then fails the parent's read (FileNotFoundError).
    received.wait(deadline_s)


def run_ranks(
    fn: Callable[..., Any],
    platform: PlatformDescription,
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout_s: float = 30.0,
    deadline_s: float = 120.0,
    device_count: int | None = None,
) -> list[Any]:
    """Call ``fn(ctx: DistContext, *args)`` on ``world_size`` ranks; return their results by rank.

    ``fn`` must be importable (module level) and its result picklable.

    :param timeout_s: the process-group timeout (a collective waiting on a missing rank raises then).
    :param deadline_s: the whole run's limit; ranks still running then are killed.
    :raises CommError: when a rank raised (its traceback is in the message) or the deadline passed.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    received = ctx.Event()  # set once the parent holds every result: the ranks may exit then
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, platform, device_count, timeout_s, fn, args, results, received, deadline_s),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    dead: dict[int, float] = {}  # rank -> when it was first seen exited without a result
    start = time.monotonic()
    try:
        while len(got) + len(gone := [r for r, t in dead.items() if time.monotonic() - t > 2.0]) < world_size:
            if time.monotonic() - start > deadline_s:
                missing = sorted(set(range(world_size)) - set(got))
                raise CommError(f"run_ranks: ranks {missing} gave no result within {deadline_s} s")
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
                dead.pop(rank, None)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in got and r not in dead and p.exitcode is not None:
                        dead[r] = time.monotonic()  # grace for a result still in the queue's pipe
    finally:
        received.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    problems = [f"rank {r} failed:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok]
    problems += [f"rank {r} exited (code {procs[r].exitcode}) without a result" for r in sorted(gone)]
    if problems:
        raise CommError("run_ranks: " + "\n".join(problems))
    return [got[r][1] for r in range(world_size)]
