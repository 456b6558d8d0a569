"""Whether this process's torch threads fit the host's cores, given what else is running on them.

OpenMP threads spin while they wait for each other; on cores that other processes keep busy a
thread that loses its core holds every other thread of the parallel region up. On a busy two-core
host a CPU decode step ran ten times slower with two torch threads than with one. :func:`check_threads`
compares the threads with the cores this process may run on (its CPU affinity) less the other
runnable work (the 1-minute load average less this process), and says what to set when they do not
fit. ``vllm-port doctor`` reports it.
"""

from __future__ import annotations

import dataclasses
import os

import torch

__all__ = ["ThreadCheck", "check_threads", "usable_cores"]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ThreadCheck:
    """Torch threads against the cores free for them. ``advice`` is ``None`` when they fit."""

    cores: int  #: usable cores (CPU affinity)
    torch_threads: int  #: ``torch.get_num_threads()``
    load_average: float | None  #: the 1-minute load average, ``None`` where the OS has none
    other_load: float  #: runnable work besides this process: the load average less one
    suggested_threads: int  #: the threads that fit: the cores less the other load, at least one
    advice: str | None

    @property
    def oversubscribed(self) -> bool:
        return self.advice is not None


def check_threads(
    cores: int | None = None, threads: int | None = None, load_average: float | None = None
) -> ThreadCheck:
    """Check the torch threads against the usable cores and the load; the arguments default to this host's values.

    Oversubscribed when the threads exceed the cores, or when the threads plus the other runnable
    work exceed the cores by more than half a core (a load average is a decaying mean: half a core
    of slack keeps a finished neighbour from raising an alarm).
    """
    cores = usable_cores() if cores is None else cores
    threads = torch.get_num_threads() if threads is None else threads
    if load_average is None:
        load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    other = max(0.0, (load_average or 0.0) - 1.0)  # the load counts this process once
    suggested = max(1, min(threads, cores - round(other)))
    advice = None
    if threads > cores:
        advice = f"{threads} torch threads on {cores} usable cores"
    elif threads > 1 and threads + other > cores + 0.5:
        advice = (
            f"{threads} torch threads on {cores} cores that other work keeps busy (load average {load_average:.2f})"
        )
    if advice is not None:
        advice += (
            f": spinning OpenMP threads wait on each other when a core is taken (a busy 2-core host decoded 10x "
            f"slower with 2 threads than with 1); set OMP_NUM_THREADS={suggested} before starting, or free the cores"
        )
    return ThreadCheck(cores, threads, load_average, other, suggested, advice)
