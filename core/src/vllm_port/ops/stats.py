"""``VLLM_PORT_STATS=FILE``: count every call of every bound op, and write the counts at process exit.

Anyone can then see which kernels ran, in this project's engine or in another engine that binds
through the runtime (the vLLM bridge): ``Runtime.bind`` wraps each chosen provider's function in a
counter (:func:`counted_ops`) before it is wrapped in anything else, so a call is counted where the
kernel really runs, also inside a custom op that a compiled graph calls. Without the setting
nothing is wrapped and a call costs what it did.

At exit a process that bound ops merges its counts into ``FILE`` under a file lock (several
processes of one engine, vLLM's front end, engine core and workers, write one file)::

    {"calls": {"rms_norm": {"cpu/cpu_rms_norm": 120}, ...},
     "processes": [{"pid": 123, "argv": [...], "calls": {...}}, ...]}

``calls`` sums every process's; an op bound but never called is listed with 0 calls.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ._registry import BoundOps

__all__ = ["STATS_ENV", "counted_ops", "snapshot", "stats_file", "write_stats"]

STATS_ENV = "VLLM_PORT_STATS"

#: (op, "plugin/provider") -> calls in this process
_calls: dict[tuple[str, str], int] = {}
_lock = threading.Lock()
_registered = False
_written = False


def stats_file() -> str | None:
    """The file ``VLLM_PORT_STATS`` names, or ``None`` when counting is off."""
    return os.environ.get(STATS_ENV) or None


def _counter(fn: Callable[..., Any], key: tuple[str, str]) -> Callable[..., Any]:
    calls = _calls

    def count_and_call(*args: Any, **kwargs: Any) -> Any:
        calls[key] += 1  # the GIL makes a dict item's increment atomic enough for a count
        return fn(*args, **kwargs)

    count_and_call.__name__ = getattr(fn, "__name__", "provider")
    count_and_call.__qualname__ = count_and_call.__name__
    count_and_call.__doc__ = fn.__doc__
    count_and_call.__module__ = fn.__module__
    count_and_call.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    count_and_call.vllm_port_counted = True  # type: ignore[attr-defined]
    return count_and_call


def counted_ops(kernels: BoundOps) -> BoundOps:
    """``kernels`` with each chosen provider's function counting its calls (keyed ``plugin/provider``).

    Registers the exit hook that writes :func:`stats_file` the first time it is called.
    """
    global _registered
    chosen = {}
    for op, provider in kernels.providers.items():
        key = (op, f"{provider.plugin}/{provider.name}")
        with _lock:
            _calls.setdefault(key, 0)
        fn = provider.fn if getattr(provider.fn, "vllm_port_counted", False) else _counter(provider.fn, key)
        chosen[op] = replace(provider, fn=fn)
    with _lock:
        if not _registered:
            atexit.register(write_stats)
            _registered = True
    return BoundOps(
        kernels.context, chosen, candidates=kernels.candidates, skipped=kernels.skipped, fallbacks=kernels.fallbacks
    )


def snapshot() -> dict[str, dict[str, int]]:
    """This process's counts so far: op -> ``plugin/provider`` -> calls."""
    out: dict[str, dict[str, int]] = {}
    for (op, who), n in sorted(_calls.items()):
        out.setdefault(op, {})[who] = n
    return out


def write_stats(path: str | None = None) -> Path | None:
    """Merge this process's counts into ``path`` (default :func:`stats_file`); ``None`` when nothing to write.

    The file is read, added to and replaced under an exclusive lock on ``path + ".lock"``, so
    processes exiting together each add their own entry. The counts written are reset, so a later
    call (the exit hook) adds only the calls made since.
    """
    global _written
    path = path or stats_file()
    if path is None or not _calls or (_written and not any(_calls.values())):
        return None
    target = Path(path)
    with _lock:
        mine = snapshot()
        for key in _calls:  # what is written is not written again by the exit hook
            _calls[key] = 0
        _written = True
    lock = open(f"{target}.lock", "a")  # held until the file is replaced
    try:
        _lock_file(lock)
        merged: dict[str, Any] = {"calls": {}, "processes": []}
        if target.exists():
            try:
                merged = json.loads(target.read_text())
            except ValueError:
                pass  # a file that is not ours: replaced
        totals = merged.setdefault("calls", {})
        for op, providers in mine.items():
            for who, n in providers.items():
                totals.setdefault(op, {})
                totals[op][who] = totals[op].get(who, 0) + n
        merged.setdefault("processes", []).append({"pid": os.getpid(), "argv": sys.argv[:4], "calls": mine})
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, target)
    finally:
        lock.close()
    return target


def _lock_file(handle: Any) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: one writer at a time is the caller's business there
        return
    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
