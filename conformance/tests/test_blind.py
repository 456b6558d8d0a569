"""The blind one-bug plugins (issue 25): bugs written without reading the suite, and every one refused.

``blind_plugins.py`` holds them (36 bugs in 7 plugins, with the verdicts of the suite before issue 25:
25 certified); ``blind_demos.py`` shows each bug on one small valid input against the reference.
Here each plugin is certified with ``vllm-port certify --check ...`` against the checks of the parts
its bugs are in (an op bug's provider: every check of it; a comm bug's: the comm checks; a memory
bug's: the memory checks), a partial run; the six one-part plugins share one ``vllm-port`` process.
Each must be refused, and every bug must be the fault of a failed check that names its part. The
checks that refuse them run and pass in the whole-suite certification of the clean CPU plugin (the
same check on the same op and dtype), so none of them refuses every plugin.
"""

from __future__ import annotations

import pytest
from blind_demos import DEMOS, MEMORY_DEMOS
from blind_plugins import BLIND, BlindBug, BlindPlugin, install
from certify_helpers import Certified, CertifyJob, run_certify_batch, same_check_on
from shared_runs import CPU_CERTIFICATION, OncePerRun

#: where a whole-part bug must be caught: the check module of its contract
_PART_CHECKS = {"communicator": "test_comm::", "migrator": "test_memory::", "allocator": "test_memory::"}
#: the plugins certified together in one ``vllm-port`` process (one shared run each): the op bugs' plugin
#: alone (its checks are most of the work), the one-part plugins together
BATCHES = {
    "blind-ops": [p for p in BLIND if p.name == "blind-ops"],
    "blind-parts": [p for p in BLIND if p.name != "blind-ops"],
}
BATCH_OF = {plugin.name: batch for batch, plugins in BATCHES.items() for plugin in plugins}


def checks_for(plugin: BlindPlugin) -> list[str]:
    """The ``--check`` IDs that certify ``plugin`` against the parts of its bugs, in the order of its bugs."""
    checks = [_PART_CHECKS.get(bug.part, f"-{bug.part}-") for bug in plugin.bugs]
    return list(dict.fromkeys(checks))


def _certify_batch(plugins: list[BlindPlugin], folder) -> dict[str, Certified]:
    site = folder / "site"
    for plugin in plugins:
        install(plugin, site)
    jobs = [
        CertifyJob(p.name, tuple(arg for check in checks_for(p) for arg in ("--check", check)), folder / p.name)
        for p in plugins
    ]
    return {p.name: run for p, run in zip(plugins, run_certify_batch(jobs, folder, site=site), strict=True)}


@pytest.fixture(scope="session")
def certified(once: OncePerRun):
    """``certified(plugin)``: its partial certification; the plugins of its batch run together, once per run."""

    def run(plugin: BlindPlugin) -> Certified:
        batch = BATCH_OF[plugin.name]
        return once(batch, lambda folder: _certify_batch(BATCHES[batch], folder))[plugin.name]

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
@pytest.mark.parametrize(
    "plugin", [pytest.param(p, id=p.name, marks=pytest.mark.xdist_group(BATCH_OF[p.name])) for p in BLIND]
)
def test_each_blind_plugin_is_refused_for_each_bug(certified, plugin):
    result = certified(plugin)
    assert result.returncode == 1, result.output[-2000:]
    assert f"{plugin.name}: not certified" in result.stdout
    assert result.report["selection"] == checks_for(plugin)
    escaped = [bug.part for bug in plugin.bugs if not _failed_for(result.report, plugin, bug)]
    assert not escaped, f"{plugin.name}: certified past its bugs in {escaped}"


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_the_checks_that_refuse_each_bug_pass_on_the_clean_cpu_plugin(certified, cpu_certified):
    states = {t["id"]: t["state"] for t in cpu_certified.report["tests"]}
    problems = []
    for plugin in BLIND:
        report = certified(plugin).report
        for bug in plugin.bugs:
            for test in _failed_for(report, plugin, bug):
                clean = same_check_on(test["id"], bug.part, list(states))
                if not clean:
                    problems.append(f"{bug.part}: the clean CPU certification ran no check like {test['id']!r}")
                problems += [
                    f"{bug.part}: {t} is {states[t]} on the clean CPU plugin" for t in clean if states[t] != "passed"
                ]
    assert not problems, "\n".join(problems)
