"""Helpers for the certification tests: install real test plugins (a module and a dist-info folder) and run ``vllm-port certify``.

As in core's tests: ``importlib.metadata`` finds a dist-info folder on ``PYTHONPATH`` exactly as it
finds pip-installed packages, so discovery, the suite and certify run their real paths. Several
certifications can share one ``vllm-port`` process (:func:`run_certify_batch`); each still runs the
suite in a fresh process of its own, as ``vllm-port certify`` always does.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_counter = itertools.count()
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Mutant:
    """One planted bug of the mutant catalogue, and the check that must refuse it.

    Attributes:
        name: the provider's name (op mutants), or the plugin's name (whole-plugin mutants).
        bug: the planted bug in one line: the catalogue table's row.
        bug_class: the class, as issue 11 words it: "precision", "shape branch", "stray writes",
            "sampling", "memory", "strides", "probe", or "caught before: <class>".
        check: the check that must fail: a unique substring of its test id in report.json, e.g.
            "test_provider_matches_reference[rms_norm-bf16_sum_rms_norm-bfloat16]".
        message: substrings its failure message must contain (the case label, the value that is wrong).
    """

    name: str
    bug: str
    bug_class: str
    check: str
    message: tuple[str, ...] = ()


@dataclass(frozen=True)
class MutantGroup:
    """One platform plugin holding one or more mutants, certified in one ``vllm-port certify`` run.

    Attributes:
        plugin: the plugin's entry-point name (unique across all groups).
        source: the plugin module's source (hook implementations, as ``write_plugin`` takes it).
        mutants: the bugs planted in it.
    """

    plugin: str
    source: str
    mutants: tuple[Mutant, ...]


def write_plugin(site: Path, name: str, source: str, version: str = "0.0.1") -> str:
    """Write plugin ``name`` (module from ``source``) with its dist-info into ``site``; return the module name."""
    module = f"vllm_port_test_{name.replace('-', '_')}_{next(_counter)}"
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = site / f"vllm_port_test_{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-port-test-{name}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm_port]\n{name} = {module}\n")
    return module


@dataclass
class Certified:
    """One ``vllm-port certify`` run: exit status, output, and the report it wrote (if any)."""

    returncode: int
    stdout: str
    stderr: str
    report_dir: Path | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def report(self) -> dict[str, Any]:
        assert self.report_dir is not None
        return json.loads((self.report_dir / "report.json").read_text())


#: seconds one certification may take on a loaded two-core machine (a whole-suite run takes about a minute alone)
CERTIFY_TIMEOUT_S = 300


def _env(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


def run_certify(*args: str, site: Path | None = None, report_dir: Path | None = None) -> Certified:
    """Run ``vllm-port certify ARGS`` in a subprocess (with ``site`` on ``PYTHONPATH``)."""
    extra = ["--report", str(report_dir)] if report_dir is not None else []
    cmd = [sys.executable, "-m", "vllm_port.cli", "certify", *args, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(site), timeout=CERTIFY_TIMEOUT_S)
    return Certified(proc.returncode, proc.stdout, proc.stderr, report_dir)


@dataclass(frozen=True)
class CertifyJob:
    """One ``vllm-port certify PLUGIN ARGS --report REPORT_DIR`` of a batch."""

    plugin: str
    args: tuple[str, ...]
    report_dir: Path


def run_certify_batch(jobs: list[CertifyJob], workdir: Path, site: Path | None = None) -> list[Certified]:
    """Run every job's ``vllm-port certify`` in one subprocess (``certify_batch.py``); their results in order.

    The same command as :func:`run_certify`, one after the other in one process: Python, torch and
    discovery start once, not once per plugin. ``workdir`` receives the batch's job and result files.
    """
    jobs_file, results_file = workdir / "jobs.json", workdir / "results.json"
    argvs = [["certify", job.plugin, *job.args, "--report", str(job.report_dir)] for job in jobs]
    jobs_file.write_text(json.dumps(argvs))
    cmd = [sys.executable, str(HERE / "certify_batch.py"), str(jobs_file), str(results_file)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=_env(site), timeout=CERTIFY_TIMEOUT_S * max(1, len(jobs))
    )
    if proc.returncode != 0 or not results_file.is_file():
        raise RuntimeError(
            f"certify_batch.py failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    results = json.loads(results_file.read_text())
    return [
        Certified(got["returncode"], got["stdout"], got["stderr"], job.report_dir)
        for job, got in zip(jobs, results, strict=True)
    ]


# ------------------------------------------------------------------------------------------------
# The mutant catalogue: every ``mutants_<area>.py`` beside this file exposes ``GROUPS``
# ------------------------------------------------------------------------------------------------

#: ``test_provider_matches_reference[op-provider-dtype]``-style check ids of op mutants
_OP_CHECK = re.compile(r"\[(?P<op>[a-z_0-9]+)-(?P<provider>[^\]]+)-(?P<dtype>float32|bfloat16|float16|float64)\]")


def mutant_batches() -> dict[str, list[MutantGroup]]:
    """The groups of each ``mutants_*.py`` module beside this file, by module name, modules in name order.

    A module's groups are certified together, in one ``vllm-port`` process (:func:`certify_groups`).
    """
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    modules = sorted(path.stem for path in HERE.glob("mutants_*.py"))
    return {name: list(importlib.import_module(name).GROUPS) for name in modules}


def mutant_groups() -> list[MutantGroup]:
    """Every group of every ``mutants_*.py`` module beside this file, modules in name order."""
    return [group for groups in mutant_batches().values() for group in groups]


def killing_checks(group: MutantGroup) -> list[str]:
    """The checks that must refuse ``group``: each mutant's, as ``--check`` IDs (unique parts of test ids)."""
    return [mutant.check for mutant in group.mutants]


def certify_groups(groups: list[MutantGroup], workdir: Path, full_suite: bool = False) -> dict[str, Certified]:
    """Install ``groups``' plugins into ``workdir/site`` and certify each, by plugin name, in one ``vllm-port`` process.

    Each group is certified against the checks that must refuse its mutants (``--check``, a partial
    run), or against the whole suite with ``full_suite``; its report lands in ``workdir/<plugin>``.
    """
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    jobs = []
    for group in groups:
        write_plugin(site, group.plugin, group.source)
        checks = () if full_suite else tuple(arg for check in killing_checks(group) for arg in ("--check", check))
        jobs.append(CertifyJob(group.plugin, checks, workdir / group.plugin))
    return {group.plugin: run for group, run in zip(groups, run_certify_batch(jobs, workdir, site=site), strict=True)}


def certify_group(group: MutantGroup, workdir: Path, full_suite: bool = False) -> Certified:
    """Certify the one group ``group`` as :func:`certify_groups` does."""
    return certify_groups([group], workdir, full_suite)[group.plugin]


def killing_check(report: dict[str, Any], mutant: Mutant) -> dict[str, Any] | None:
    """The report's entry for ``mutant.check`` (a unique substring of one test id), or None if absent."""
    found = [t for t in report["tests"] if mutant.check in t["id"]]
    if len(found) > 1:
        raise ValueError(f"mutant {mutant.name!r}: check {mutant.check!r} matches {len(found)} tests; make it unique")
    return found[0] if found else None


def same_check_on(check: str, provider: str, test_ids: list[str]) -> list[str]:
    """The ids among ``test_ids`` (another plugin's report) of ``check`` (a test id, or a unique part of one) as run there.

    For a check of the provider ``provider`` (``...[op-provider-dtype]``): the same check of the
    same op and dtype on any provider; for any other check: the ids that contain ``check``.
    """
    op_check = _OP_CHECK.search(check)
    if op_check is None or op_check["provider"] != provider:
        return [t for t in test_ids if check in t]
    head = re.escape(check[: op_check.start()])
    same = re.compile(rf"{head}\[{op_check['op']}-[^\]]+-{op_check['dtype']}\]$")
    return [t for t in test_ids if same.search(t)]


def expected_parts(group: MutantGroup, mutant: Mutant) -> list[str]:
    """What the killing check's message must contain: the plugin, for op mutants provider, op and dtype, the mutant's parts."""
    parts = [f"plugin {group.plugin!r}"]
    op_check = _OP_CHECK.search(mutant.check)
    if op_check and op_check["provider"] == mutant.name:
        parts += [f"provider {mutant.name!r}", f"op {op_check['op']!r}", f"torch.{op_check['dtype']}"]
    return parts + list(mutant.message)


def kill_problems(group: MutantGroup, mutant: Mutant, report: dict[str, Any]) -> list[str]:
    """Why ``mutant`` is not killed as its entry says (empty when it is)."""
    test = killing_check(report, mutant)
    if test is None:
        return [f"no check {mutant.check!r} ran"]
    if test["state"] not in ("failed", "error"):
        return [f"{test['id']} {test['state']}: the mutant survived"]
    message = test["message"] or ""
    missing = [part for part in expected_parts(group, mutant) if part not in message]
    return [f"{test['id']} failed without {part!r} in: {message[:400]}" for part in missing]
