"""The mutant catalogue: every planted-bug plugin beside this file is certified against the checks that must refuse it.

Each ``mutants_<area>.py`` module here exposes ``GROUPS``: platform plugins holding one or more
mutants, each with one realistic bug (see ``certify_helpers.Mutant``). Each group is certified once
with ``vllm-port certify --check ...``, naming the checks its catalogue entries say kill its mutants
(a partial run; the groups of one module share one ``vllm-port`` process). Certification must
refuse it (exit 1, "not certified") through exactly those checks, and each mutant's own check must
fail (or error) with a message that names the plugin, for an op mutant also the provider, op and
dtype, and the mutant's parts (the case to replay, the wrong value).

Why a partial run proves what a whole-suite run would: its report holds the selected checks and
nothing else, each of them failed, so the refusal is theirs; and every one of those checks is run
and passed by the whole-suite certification of the clean CPU plugin (an op mutant's: the same check
on the same op and dtype), so none of them refuses every plugin: a check that failed for everyone
would kill every mutant vacuously. ``python conformance/tests/mutant_catalogue.py`` writes the same
runs as docs/conformance-mutants.md (``--full-suite``: each group against the whole suite).
"""

from __future__ import annotations

import pytest
from certify_helpers import (
    Certified,
    MutantGroup,
    certify_groups,
    kill_problems,
    killing_check,
    killing_checks,
    mutant_batches,
    same_check_on,
)
from shared_runs import CPU_CERTIFICATION, OncePerRun

BATCHES = mutant_batches()
GROUPS = [group for groups in BATCHES.values() for group in groups]
#: the catalogue module (and shared run) each group is certified in, by plugin name
BATCH_OF = {group.plugin: batch for batch, groups in BATCHES.items() for group in groups}


@pytest.fixture(scope="session")
def certified(once: OncePerRun):
    """``certified(group)``: the group's partial certification; its module's groups run together, once per run."""

    def run(group: MutantGroup) -> Certified:
        batch = BATCH_OF[group.plugin]
        return once(batch, lambda folder: certify_groups(BATCHES[batch], folder))[group.plugin]

    return run


def _in_its_batch(group: MutantGroup, *values: object, id: str) -> object:
    return pytest.param(group, *values, id=id, marks=pytest.mark.xdist_group(BATCH_OF[group.plugin]))


def test_the_catalogue_is_well_formed():
    plugins = [g.plugin for g in GROUPS]
    names = [m.name for g in GROUPS for m in g.mutants]
    assert len(set(plugins)) == len(plugins), f"plugin names repeat: {sorted(plugins)}"
    assert len(set(names)) == len(names), f"mutant names repeat: {sorted(names)}"
    assert all(m.bug and m.bug_class and m.check for g in GROUPS for m in g.mutants)
    assert len(names) >= 30, f"the catalogue holds {len(names)} mutants; issue 11 asks for 30 or more"


@pytest.mark.slow
@pytest.mark.parametrize("group", [_in_its_batch(g, id=g.plugin) for g in GROUPS])
def test_each_group_is_refused(certified, group):
    result = certified(group)
    assert result.returncode == 1, result.output
    assert f"{group.plugin}: not certified" in result.stdout
    assert result.report["verdict"] == "not certified"
    # a partial run of its mutants' checks, one test each, and every one of them failed: the refusal is theirs
    report = result.report
    assert report["selection"] == killing_checks(group)
    ran = sorted(t["id"] for t in report["tests"])
    refused_by = sorted(t["id"] for t in report["tests"] if t["state"] in ("failed", "error"))
    assert ran == refused_by and len(ran) == len(group.mutants), report["reason"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("group", "mutant"),
    [_in_its_batch(g, m, id=f"{g.plugin}-{m.name}") for g in GROUPS for m in g.mutants],
)
def test_each_mutant_is_killed_by_its_check(certified, group, mutant):
    report = certified(group).report
    problems = kill_problems(group, mutant, report)
    assert not problems, "; ".join(problems)
    test = killing_check(report, mutant)
    assert test["id"] in certified(group).stdout  # the summary names the check that failed
    cells = [c for c in report["coverage"] if c["provider"] == mutant.name]
    assert all(c["passed"] < c["total"] for c in cells), cells  # an op mutant's coverage shows the failure


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_each_killing_check_passes_on_the_clean_cpu_plugin(cpu_certified):
    """Every check that kills a mutant runs and passes in the whole-suite certification of the clean CPU plugin."""
    states = {t["id"]: t["state"] for t in cpu_certified.report["tests"]}
    problems = []
    for group in GROUPS:
        for mutant in group.mutants:
            clean = same_check_on(mutant.check, mutant.name, list(states))
            if not clean:
                problems.append(f"{mutant.name}: the clean CPU certification ran no check like {mutant.check!r}")
            problems += [
                f"{mutant.name}: {t} is {states[t]} on the clean CPU plugin" for t in clean if states[t] != "passed"
            ]
    assert not problems, "\n".join(problems)
