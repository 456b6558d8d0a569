"""The mutant catalogue: every planted-bug plugin beside this file is certified, and refused.

Each ``mutants_<area>.py`` module here exposes ``GROUPS``: platform plugins holding one or more
mutants, each with one realistic bug (see ``certify_helpers.Mutant``). Each group is certified once
with ``vllm-port certify``; certification must refuse it (exit 1, "not certified"), and each
mutant's own check must fail (or error) with a message that names the plugin, for an op mutant
also the provider, op and dtype, and the mutant's parts (the case to replay, the wrong value).
``python conformance/tests/mutant_catalogue.py`` writes the same runs as docs/conformance-mutants.md.
"""

from __future__ import annotations

import re

import pytest
from certify_helpers import Certified, MutantGroup, certify_group, kill_problems, killing_check, mutant_groups

GROUPS = mutant_groups()
_runs: dict[str, Certified] = {}


@pytest.fixture(scope="module")
def certified(tmp_path_factory):
    """``certified(group)``: the group's certification, run on first use and kept for the module."""

    def run(group: MutantGroup) -> Certified:
        if group.plugin not in _runs:
            _runs[group.plugin] = certify_group(group, tmp_path_factory.mktemp(re.sub(r"\W", "_", group.plugin)))
        return _runs[group.plugin]

    return run


def test_the_catalogue_is_well_formed():
    plugins = [g.plugin for g in GROUPS]
    names = [m.name for g in GROUPS for m in g.mutants]
    assert len(set(plugins)) == len(plugins), f"plugin names repeat: {sorted(plugins)}"
    assert len(set(names)) == len(names), f"mutant names repeat: {sorted(names)}"
    assert all(m.bug and m.bug_class and m.check for g in GROUPS for m in g.mutants)
    assert len(names) >= 30, f"the catalogue holds {len(names)} mutants; issue 11 asks for 30 or more"


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.plugin)
def test_each_group_is_refused(certified, group):
    result = certified(group)
    assert result.returncode == 1, result.output
    assert f"{group.plugin}: not certified" in result.stdout
    assert result.report["verdict"] == "not certified"


@pytest.mark.parametrize(
    ("group", "mutant"),
    [pytest.param(g, m, id=f"{g.plugin}-{m.name}") for g in GROUPS for m in g.mutants],
)
def test_each_mutant_is_killed_by_its_check(certified, group, mutant):
    report = certified(group).report
    problems = kill_problems(group, mutant, report)
    assert not problems, "; ".join(problems)
    test = killing_check(report, mutant)
    assert test["id"] in certified(group).stdout  # the summary names the check that failed
    cells = [c for c in report["coverage"] if c["provider"] == mutant.name]
    assert all(c["passed"] < c["total"] for c in cells), cells  # an op mutant's coverage shows the failure
