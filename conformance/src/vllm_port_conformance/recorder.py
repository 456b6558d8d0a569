"""A pytest plugin that records every test's outcome for ``vllm-port certify``.

Loaded with ``-p vllm_port_conformance.recorder --vllm-port-record FILE``; writes one JSON object:
``{"tests": [{"id", "state", "duration_s", "message"}...], "seed", "exit_status", "selection", "collected",
"unmatched_checks"}``; a test's ``record_property`` values ride along as its ``properties``. It also
fixes the randomness: Python's and torch's global seeds before each test, and a hypothesis profile
with ``derandomize=True`` (the same examples every run, so a failure replays).

A check that the run's scope excludes (a multi-device check when certifying for one device) calls
:func:`out_of_scope`: it is recorded as ``out_of_scope``, which certification tells apart from a skip.
``--vllm-port-devices N`` sets that scope: certify as deployed on ``N`` devices.

``--vllm-port-check ID`` (repeatable) runs only the checks whose id (as the record names it,
``test_ops::test_x[case]``) contains one of the IDs: a partial run, which certification never
takes for a certificate. An ID that selects nothing deselects every check and is named in the
record's ``unmatched_checks``, so a misspelt selection is an error rather than an empty pass.

With :data:`~vllm_port_conformance.progress.PROGRESS_ENV` set to a file, it appends a line per
finished check, ``DONE PLANNED CHECK-ID``, which ``certify`` follows to show its progress.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from .progress import PROGRESS_ENV

RECORD_OPTION = "--vllm-port-record"
DEVICES_OPTION = "--vllm-port-devices"
CHECK_OPTION = "--vllm-port-check"
OUT_OF_SCOPE = "out_of_scope"
SEED = 0
HYPOTHESIS_PROFILE = "vllm-port-certify"
MESSAGE_LIMIT = 4000


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-port")
    group.addoption(RECORD_OPTION, default=None, help="write each test's outcome to this JSON file")
    group.addoption(
        DEVICES_OPTION,
        type=int,
        default=None,
        metavar="N",
        help="certify for N devices: checks that need more are recorded as out of scope (default: all found)",
    )
    group.addoption(
        CHECK_OPTION,
        action="append",
        default=[],
        metavar="ID",
        help="run only the checks whose id contains ID (repeatable; ids as report.json lists them)",
    )


def out_of_scope(item: pytest.Item, reason: str) -> None:
    """End the calling check as out of this run's scope (recorded ``out_of_scope``, not ``skipped``)."""
    item.user_properties.append((OUT_OF_SCOPE, reason))
    pytest.skip(f"out of scope: {reason}")


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        HYPOTHESIS_PROFILE, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    settings.load_profile(HYPOTHESIS_PROFILE)
    recorder = Recorder(config.getoption(RECORD_OPTION), config.getoption(CHECK_OPTION))
    config.pluginmanager.register(recorder, "vllm-port-recorder")


def test_id(nodeid: str, location: str = "") -> str:
    """``.../checks/test_ops.py::test_x[case]`` -> ``test_ops::test_x[case]`` (independent of the rootdir).

    :param location: the test's file, for a node id without one (pytest run on a single module by name).
    """
    path, _, rest = nodeid.partition("::")
    path = path or location
    return f"{Path(path).stem}::{rest}" if rest else Path(path).stem


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    text = report.longreprtext
    at = text.find("Falsifying example")  # hypothesis: the example to replay
    if at >= 0:
        message += "\n" + text[at : at + 1500]
    return message[:MESSAGE_LIMIT]


def selected(check: str, selectors: list[str]) -> bool:
    """Whether the check ``check`` (a record id) is one that ``selectors`` ask for: its id contains one of them."""
    return any(s in check for s in selectors)


class Recorder:
    def __init__(self, path: str | None, selectors: list[str] | None = None) -> None:
        self.path = path
        self.selectors = list(selectors or [])
        self.collected = 0
        self.unmatched: list[str] = []
        self.tests: dict[str, dict[str, Any]] = {}
        self.progress_file = os.environ.get(PROGRESS_ENV) or None
        self.planned = self.done = 0

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.planned = len(session.items)  # after every deselection

    def _progress(self, report: pytest.TestReport) -> None:
        """One line per finished check (its teardown reported) to the progress file ``certify`` follows."""
        if self.progress_file is None or report.when != "teardown":
            return
        self.done += 1
        check = test_id(report.nodeid, report.location[0] if report.location else "")
        with open(self.progress_file, "a", encoding="utf-8") as f:
            f.write(f"{self.done} {self.planned} {check}\n")

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Keep only the selected checks (``--vllm-port-check``); none at all if a selector matches nothing."""
        self.collected = len(items)
        if not self.selectors:
            return
        ids = [test_id(item.nodeid, item.location[0]) for item in items]
        self.unmatched = [s for s in self.selectors if not any(s in check for check in ids)]
        wanted = [not self.unmatched and selected(check, self.selectors) for check in ids]
        config.hook.pytest_deselected(items=[item for item, keep in zip(items, wanted, strict=True) if not keep])
        items[:] = [item for item, keep in zip(items, wanted, strict=True) if keep]

    def _entry(self, report: pytest.TestReport) -> dict[str, Any]:
        key = test_id(report.nodeid, report.location[0] if report.location else "")
        return self.tests.setdefault(key, {"state": "passed", "duration_s": 0.0, "message": ""})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        import torch

        random.seed(SEED)
        torch.manual_seed(SEED)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._progress(report)
        entry = self._entry(report)
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 6)
        properties = {k: v for k, v in report.user_properties if k != OUT_OF_SCOPE}
        if properties:
            entry.setdefault("properties", {}).update(properties)
        if entry["state"] != "passed":
            return  # the first thing that went wrong is the outcome
        scope = dict(report.user_properties).get(OUT_OF_SCOPE)
        if report.skipped and scope is not None:
            entry.update(state=OUT_OF_SCOPE, message=f"out of scope: {scope}")
        elif report.skipped:
            entry.update(state="skipped", message=_message(report))
        elif report.failed:
            entry.update(state="failed" if report.when == "call" else "error", message=_message(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.tests[test_id(report.nodeid) or "collection"] = {
                "state": "error",
                "duration_s": 0.0,
                "message": "collection failed: " + _message(report),
            }

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.path:
            return
        tests = [{"id": k, **v} for k, v in self.tests.items()]
        data = {
            "tests": tests,
            "seed": SEED,
            "hypothesis_profile": HYPOTHESIS_PROFILE,
            "exit_status": int(exitstatus),
            "selection": self.selectors,
            "collected": self.collected,
            "unmatched_checks": self.unmatched,
        }
        Path(self.path).write_text(json.dumps(data, indent=1))
