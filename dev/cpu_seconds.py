"""A pytest plugin: the CPU seconds of each test, its own and its subprocesses', slowest first.

Wall time (``--durations``) on a shared two-core machine says how busy the machine was; CPU seconds
say what a test costs, and most of the suite's cost is in the processes tests start (certifications,
ranks, venvs), which ``--durations`` does not separate. Usage, one process::

    PYTHONPATH=dev .venv/bin/python -m pytest -n 0 -p cpu_seconds core/tests/test_x.py

prints the 30 costliest tests at the end (``CPU_SECONDS_TOP=N`` for more). A session fixture's cost
lands on the first test that uses it; a subprocess counts once it has been waited for. Under
pytest-xdist the workers' summaries are not shown: ``CPU_SECONDS_FILE=PATH`` makes every process
append its tests' costs to PATH as JSON lines instead (``{"own": s, "children": s, "test": id}``).
"""

from __future__ import annotations

import json
import os
import resource

import pytest

_costs: list[tuple[float, float, str]] = []  # (own CPU s, subprocesses' CPU s, test id)


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    own, children = _cpu()
    try:
        return (yield)
    finally:
        own_after, children_after = _cpu()
        _costs.append((own_after - own, children_after - children, item.nodeid))
        if path := os.environ.get("CPU_SECONDS_FILE"):
            with open(path, "a") as out:
                out.write(
                    json.dumps({"own": own_after - own, "children": children_after - children, "test": item.nodeid})
                    + "\n"
                )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    top = int(os.environ.get("CPU_SECONDS_TOP", "30"))
    own, children = _cpu()
    terminalreporter.section(f"CPU seconds: {own:.1f} this process, {children:.1f} its subprocesses")
    for test_own, test_children, nodeid in sorted(_costs, key=lambda c: -(c[0] + c[1]))[:top]:
        terminalreporter.write_line(
            f"{test_own + test_children:7.1f}  (own {test_own:6.1f}, subprocesses {test_children:6.1f})  {nodeid}"
        )
