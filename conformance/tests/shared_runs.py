"""Runs made once per pytest run and shared by every test that reads them, under pytest-xdist too.

A certification takes from a few seconds (a partial run, ``--check``) to a minute (the whole suite),
and many tests read one report. :class:`OncePerRun` runs each once per pytest run, keyed by name:
under pytest-xdist every worker may ask; the first runs it under a file lock in the temporary
folder all workers of the run share, and the others wait for it and read its result. The tests
that read one run also carry an ``xdist_group`` mark of its key, so ``--dist loadgroup`` keeps them
on one worker and nobody waits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from certify_helpers import Certified
from filelock import FileLock  # a dependency of torch's

T = TypeVar("T")
#: the key (and xdist group) of the whole-suite certification of the CPU plugin that the report-reading tests share
CPU_CERTIFICATION = "certify-cpu"


class OncePerRun:
    """Results computed once per pytest run, shared by every xdist worker.

    A result travels between workers as JSON (nothing here unpickles): plain values, paths and
    :class:`Certified` runs, in lists and string-keyed dicts.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._here: dict[str, tuple[bool, Any]] = {}

    @classmethod
    def for_run(cls, basetemp: Path) -> OncePerRun:
        """The one for this pytest run, given this process's ``basetemp``: a worker's is ``<run>/popen-gwN``."""
        shared = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
        return cls(shared / "once-per-run")

    def __call__(self, key: str, make: Callable[[Path], T]) -> T:
        """The result of ``make(folder)`` for ``key``; run here if no worker of this run has run it yet.

        ``folder`` is a fresh folder for the run's files; it stays for the whole pytest run. When
        ``make`` raised, every caller gets a ``RuntimeError`` with its traceback (it is not run again).
        """
        if key not in self._here:
            self.root.mkdir(parents=True, exist_ok=True)
            done = self.root / f"{key}.json"
            with FileLock(str(self.root / f"{key}.lock")):
                if not done.is_file():
                    done.write_text(json.dumps(_encode(_outcome(key, make, self.root))))
                self._here[key] = tuple(_decode(json.loads(done.read_text())))
        ok, value = self._here[key]
        if not ok:
            raise RuntimeError(f"the shared run {key!r} failed (in whichever worker ran it first):\n{value}")
        return value


def _outcome(key: str, make: Callable[[Path], Any], root: Path) -> tuple[bool, Any]:
    """``(True, result)``, or ``(False, traceback)`` when ``make`` raised."""
    try:
        return True, make(Path(tempfile.mkdtemp(prefix=f"{key}-", dir=root)))
    except Exception:
        return False, traceback.format_exc()


def _encode(value: Any) -> Any:
    """``value`` as JSON values, paths and :class:`Certified` runs tagged so :func:`_decode` rebuilds them."""
    if isinstance(value, Certified):
        return {"__certified__": {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, Path):
        return {"__path__": str(value)}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"a shared run's dict needs string keys to travel as JSON, got {list(value)[:3]}")
        return {k: _encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"a shared run returned a {type(value).__name__}, which cannot travel between workers as JSON")


def _decode(value: Any) -> Any:
    """The inverse of :func:`_encode`."""
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__path__"}:
            return Path(value["__path__"])
        if set(value) == {"__certified__"}:
            return Certified(**{k: _decode(v) for k, v in value["__certified__"].items()})
        return {k: _decode(v) for k, v in value.items()}
    return value
