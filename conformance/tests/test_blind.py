"""The blind one-bug plugins (issue 25): bugs written without reading the suite, and every one refused.

``blind_plugins.py`` holds them (36 bugs in 7 plugins, with the verdicts of the suite before issue 25:
25 certified); ``blind_demos.py`` shows each bug on one small valid input against the reference.
Here each plugin is certified with ``vllm-port certify``: it must be refused, and every bug must be
the fault of a failed check that names its part (an op bug's provider; a comm bug's failure in the
comm checks, a memory bug's in the memory checks).
"""

from __future__ import annotations

import re

import pytest
from blind_demos import DEMOS, MEMORY_DEMOS
from blind_plugins import BLIND, BlindBug, BlindPlugin, install
from certify_helpers import Certified, run_certify

#: where a whole-part bug must be caught: the check module of its contract
_PART_CHECKS = {"communicator": "test_comm::", "migrator": "test_memory::", "allocator": "test_memory::"}
_runs: dict[str, Certified] = {}


@pytest.fixture(scope="module")
def certified(tmp_path_factory):
    """``certified(plugin)``: its certification, run on first use and kept for the module."""

    def run(plugin: BlindPlugin) -> Certified:
        if plugin.name not in _runs:
            work = tmp_path_factory.mktemp(re.sub(r"\W", "_", plugin.name))
            site = install(plugin, work / "site")
            _runs[plugin.name] = run_certify(plugin.name, site=site, report_dir=work / "report")
        return _runs[plugin.name]

    return run


def _failed_for(report: dict, plugin: BlindPlugin, bug: BlindBug) -> list[dict]:
    failed = [t for t in report["tests"] if t["state"] in ("failed", "error")]
    if bug.part in _PART_CHECKS:
        return [t for t in failed if _PART_CHECKS[bug.part] in t["id"] and f"{plugin.name!r}" in (t["message"] or "")]
    return [t for t in failed if f"-{bug.part}-" in t["id"] and f"provider {bug.part!r}" in (t["message"] or "")]


@pytest.mark.parametrize("name", sorted(DEMOS) + sorted(MEMORY_DEMOS))
def test_each_bug_is_real(name):
    """The planted bug shows on a small valid input: far off the reference, beyond any op's tolerance."""
    demos = {**DEMOS, **MEMORY_DEMOS}
    assert demos[name]() > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("plugin", BLIND, ids=lambda p: p.name)
def test_each_blind_plugin_is_refused_for_each_bug(certified, plugin):
    result = certified(plugin)
    assert result.returncode == 1, result.output[-2000:]
    assert f"{plugin.name}: not certified" in result.stdout
    escaped = [bug.part for bug in plugin.bugs if not _failed_for(result.report, plugin, bug)]
    assert not escaped, f"{plugin.name}: certified past its bugs in {escaped}"
