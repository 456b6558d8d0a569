"""``vllm-port certify``: run the conformance suite on one plugin and write a verifiable report.

A plugin is *certified* when its platform is available here (real hardware; the host CPU counts
for ``cpu``) and every collected check passed or is waived. The suite runs in a subprocess under
the :mod:`~vllm_port_conformance.recorder` plugin, with fixed seeds and derandomized hypothesis.
The report (``report.json``, ``report.md``) carries a sha256 digest over its canonical JSON, so
``vllm-port certify --verify report.json`` notices an edited or truncated report.

The report's *scope* says what the certificate covers: on a machine with one device (or with
``--devices 1``) the comm checks run on a world of one and those that need a second device are
``out_of_scope``; the plugin is then "certified for 1 device". Any other skip still blocks
certification. A plugin that fails to load (its import, its hooks or its probe: one that hangs past
discovery's limit included) is "not certified"; only a clean probe that finds no device gives
"could not run".

``--check ID`` (repeatable) runs only the checks whose id contains one of the IDs, through the same
suite, recorder and verdict: a *partial run*, whose report names its ``selection``. A failure in it
refuses the plugin as in a full run; a partial run that passes is still "not certified" (a
certificate needs the whole suite). The mutant catalogue is certified this way, each planted bug
against the checks that must catch it.

Where vLLM and the vLLM bridge are installed beside the plugin, a whole run that passes goes on to a
last stage inside vLLM (:mod:`~vllm_port_conformance.inside_vllm`): a tiny Llama, then a tiny Mixtral,
in vLLM with the bridge on the plugin's kernels against vLLM alone, logits within the ops' tolerances. Its result is
the report's ``vllm`` field, and a failure there refuses the plugin (``--vllm skip|require``).

Exit status: 0 certified (or report verified), 1 not certified (or report rejected),
2 could not run (device absent, unknown plugin).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform as host
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from . import inside_vllm
from .progress import PROGRESS_ENV, ProgressFile, ProgressLine
from .recorder import CHECK_OPTION, DEVICES_OPTION, HYPOTHESIS_PROFILE, OUT_OF_SCOPE, RECORD_OPTION, SEED

__all__ = [
    "STATES",
    "Waiver",
    "certify",
    "digest",
    "headline",
    "load_waivers",
    "main",
    "run_packages",
    "scope_of",
    "source_digest",
    "verify",
]

#: the closed set of states a test can end in; ``out_of_scope``: beyond the report's scope (see ``scope``)
STATES = ("passed", "failed", "error", "skipped", "waived", OUT_OF_SCOPE)
VERDICTS = ("certified", "not certified", "could not run")
#: 2: the source digest; 3: the scope, the first probe, every distribution in the digest; 4: the plugin's own
#: commit (``plugin.git``), for plugins whose source lives outside vllm-port's repository; 5: the ``selection``
#: of a partial run (``--check``; ``null`` for the whole suite); 6: ``vllm``, the stage inside vLLM (ran or why not);
#: 7: the source digest covers every file of the packages (native sources, data), not only their ``.py``
REPORT_VERSION = 7
#: the first version whose source digest :func:`source_digest` computes today; older ones cannot be compared
SOURCE_DIGEST_SINCE = 7
REQUIRED_KEYS = (
    "report_version",
    "plugin",
    "versions",
    "git",
    "source",
    "device",
    "command",
    "seeds",
    "tests",
    "summary",
    "coverage",
    "tolerances",
    "waivers",
    "timing",
    "verdict",
    "reason",
    "digest",
)
REQUIRED_KEYS_V3 = ("scope", "probe")
REQUIRED_KEYS_V5 = ("selection",)
REQUIRED_KEYS_V6 = ("vllm",)
#: what a version 4 report says about the plugin
PLUGIN_KEYS_V4 = ("name", "distribution", "version", "git")
#: the only checks a report may leave out of scope: those of comm that need a second device
SCOPED_TESTS = "test_comm::"
SUITE = "vllm_port_conformance.checks"
#: what a plugin that fails to load is still checked by: the checks that say why
LOAD_CHECKS = "vllm_port_conformance.checks.test_platform"
DEFAULT_WAIVERS = Path(__file__).resolve().parent / "waivers.toml"  # package data: found from a wheel too
#: the checks of one provider and dtype, counted in the report's coverage (ids ``op-provider-dtype``): a
#: sampler's equivalence check too, the only one a sampler that draws allowed tokens but not the
#: reference's fails (top_k -1 taken for 1: always the argmax)
OP_TESTS = ("test_ops::test_provider_", "test_sampling::test_sampler_equivalence")
COMMIT_ENV = "VLLM_PORT_GIT_COMMIT"
PLUGIN_COMMIT_ENV = "VLLM_PORT_PLUGIN_GIT_COMMIT"


@dataclass(frozen=True)
class Waiver:
    test: str
    reason: str
    plugin: str = ""  # empty: every plugin


def load_waivers(path: Path | None, plugin: str) -> list[Waiver]:
    """Waivers for ``plugin`` from a TOML file of ``[[waiver]] test = "...", reason = "...", plugin = "..."``."""
    if path is None:
        path = DEFAULT_WAIVERS
        if not path.is_file():
            return []
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    data = tomllib.loads(Path(path).read_text())
    waivers = []
    for i, entry in enumerate(data.get("waiver", [])):
        if not entry.get("test") or not str(entry.get("reason", "")).strip():
            raise ValueError(f"{path}: waiver {i + 1} needs a test id and a reason")
        w = Waiver(str(entry["test"]), str(entry["reason"]), str(entry.get("plugin", "")))
        if w.plugin in ("", plugin):
            waivers.append(w)
    return waivers


def digest(report: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of the report without its ``digest`` field."""
    body = {k: v for k, v in report.items() if k != "digest"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"


def _git() -> dict[str, Any]:
    """The commit and dirty flag of the checkout the suite runs from; a runner that copies the tree
    to another machine (where a stale or no ``.git`` may be) names the commit it sent in
    ``VLLM_PORT_GIT_COMMIT``, which wins. The source digest ties either to the files."""
    sent = os.environ.get(COMMIT_ENV, "").strip()
    if sent:
        return {"commit": sent, "dirty": "unknown", "from": f"{COMMIT_ENV}, set by the runner"}
    here = Path(__file__).resolve()
    return _git_at(here.parent, here)


def _git_at(where: Path, tracked: Path | None = None) -> dict[str, Any]:
    """The commit and dirty flag of the git checkout at ``where``, when ``tracked`` is one of its files.

    A file that is not tracked there (an installed copy in a virtualenv that happens to lie inside
    some repository, such as a vendor's ``.tox/``) gives ``unknown``: that repository's commit is not
    the file's.
    """
    git = shutil.which("git")
    if git is None or not where.is_dir():
        return {"commit": "unknown", "dirty": "unknown"}

    def run(*args: str) -> str:
        # S603: the arguments are constants and paths; git is the one found on PATH
        return subprocess.run(  # noqa: S603
            [git, *args], cwd=where, capture_output=True, text=True, timeout=30, check=True
        ).stdout

    try:
        if tracked is not None:
            run("ls-files", "--error-unmatch", str(tracked))
        commit, status = run("rev-parse", "HEAD").strip(), run("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return {"commit": "unknown", "dirty": "unknown"}
    return {"commit": commit, "dirty": bool(status.strip())}


def plugin_git(plugin: str) -> dict[str, Any]:
    """The commit of the plugin's own source, which may live outside vllm-port's repository.

    In order: ``VLLM_PORT_PLUGIN_GIT_COMMIT`` (a runner that copied the vendor's tree names it); the
    git checkout the plugin's module is imported from (an editable install, as tox's and pip's
    ``-e``); the commit pip recorded when it installed from a VCS URL; the checkout of the local
    folder pip installed from. Otherwise ``unknown``, with what to do about it.
    """
    sent = os.environ.get(PLUGIN_COMMIT_ENV, "").strip()
    if sent:
        return {"commit": sent, "dirty": "unknown", "from": f"{PLUGIN_COMMIT_ENV}, set by the runner"}
    ep = next((e for e in metadata.entry_points(group="vllm_port") if e.name == plugin), None)
    if ep is None:
        return {"commit": "unknown", "dirty": "unknown", "from": f"no installed plugin is called {plugin!r}"}
    try:
        spec = importlib.util.find_spec(ep.module)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin is not None:
        origin = Path(spec.origin).resolve()
        found = _git_at(origin.parent, origin)
        if found["commit"] != "unknown":
            return {**found, "from": f"the checkout of {origin.parent}"}
    direct = _direct_url(ep)
    if "vcs_info" in direct and direct["vcs_info"].get("commit_id"):
        return {"commit": direct["vcs_info"]["commit_id"], "dirty": False, "from": f"pip installed {direct['url']}"}
    if "dir_info" in direct and str(direct.get("url", "")).startswith("file://"):
        folder = Path(direct["url"].removeprefix("file://"))
        found = _git_at(folder, folder / "pyproject.toml")
        if found["commit"] != "unknown":
            return {**found, "from": f"the checkout pip installed from ({folder})"}
    return {
        "commit": "unknown",
        "dirty": "unknown",
        "from": f"not installed from a git checkout; name the commit in {PLUGIN_COMMIT_ENV}",
    }


def _direct_url(ep: Any) -> dict[str, Any]:
    """PEP 610's record of where pip installed the entry point's distribution from (empty when none)."""
    dist = getattr(ep, "dist", None)
    text = dist.read_text("direct_url.json") if dist is not None else None
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def _top(module: Any) -> str:
    name = module if isinstance(module, str) else getattr(module, "__name__", type(module).__module__)
    return str(name).split(".")[0]


def run_packages(plugin: str, discovery: Any = None) -> list[str]:
    """The top-level packages whose code the run used: core and the suite, the plugin's, and those of
    every plugin registered with pluggy, every hook implementation and every op provider in
    ``discovery`` (the plugin's discovery as the suite makes it: ``discover(plugins=plugin)``).

    A plugin may register a hook implemented in another distribution, or a provider whose kernel
    lives in one; their sources ran and belong in the digest.
    """
    wanted = {"vllm_port", "vllm_port_conformance"}
    wanted |= {_top(ep.module) for ep in metadata.entry_points(group="vllm_port") if ep.name == plugin}
    if discovery is not None:
        manager = discovery.manager
        wanted |= {_top(p) for p in manager.get_plugins()}
        for caller in vars(manager.hook).values():
            wanted |= {_top(impl.function.__module__) for impl in getattr(caller, "get_hookimpls", list)()}
        for op in discovery.registry.ops:
            wanted |= {_top(p.fn.__module__) for p in discovery.registry.candidates(op)}
    return sorted(wanted)


def source_digest(packages: Iterable[str], distributions: Iterable[str] = ()) -> dict[str, Any]:
    """sha256 over every file of ``packages`` (see :func:`run_packages`), by relative path.

    It ties a report to code where git cannot (a copied tree): anyone can compute it from a
    checkout with the packages installed and compare. Every file a package holds counts, not only
    its Python: a native source it compiles at first use (the CPU plugin's ``csrc/``), a kernel
    configuration or the waivers file changes what ran as surely as a ``.py`` does. Only bytecode
    (``__pycache__``, ``*.pyc``) is left out, since the interpreter writes it. A single-module
    distribution counts as its one file. ``distributions`` (the plugins' own, from discovery) are
    listed beside those that the installed metadata names as owners of the packages.
    """
    sha, files, hashed, dists = hashlib.sha256(), 0, [], set(distributions)
    owners = metadata.packages_distributions()
    for package in sorted(set(packages)):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:  # not importable: not listed, so the report does not claim it
            continue
        origin = Path(spec.origin)
        if spec.submodule_search_locations:
            paths = [(f"{package}/{p.relative_to(origin.parent).as_posix()}", p) for p in _package_files(origin.parent)]
        else:
            paths = [(origin.name, origin)]
        for name, path in sorted(paths):
            sha.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
            files += 1
        hashed.append(package)
        dists.update(owners.get(package, []))
    return {"packages": hashed, "distributions": sorted(dists), "files": files, "sha256": sha.hexdigest()}


def _package_files(root: Path) -> list[Path]:
    """The files under a package's directory that its source digest covers: all but bytecode."""
    return [
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix != ".pyc" and "__pycache__" not in p.relative_to(root).parts
    ]


def _fingerprint(record) -> dict[str, Any]:
    desc, probe = record.description, record.probe
    caps = dict(probe.capabilities) if probe is not None else {}
    return {
        "platform": desc.name if desc else None,
        "device_type": desc.device_type if desc else None,
        "available": record.available,
        "reason": (probe.reason if probe is not None and record.error is None else record.error) or "",
        "error": record.error,
        "devices": [
            {"name": d.name, "total_memory": d.total_memory, "arch": d.arch} for d in (probe.devices if probe else ())
        ],
        "capabilities": caps,
        "driver": next((caps[k] for k in ("driver", "driver_version") if k in caps), None),
        "host": {"machine": host.machine(), "system": host.system(), "python": host.python_version()},
    }


def _tolerances() -> list[dict[str, Any]]:
    from vllm_port.ops import ALL_OPS

    return [
        {"op": op.name, "dtype": str(dtype).removeprefix("torch."), "atol": t.atol, "rtol": t.rtol, "reason": t.reason}
        for op in ALL_OPS
        for dtype, t in sorted(op.tolerances.items(), key=lambda kv: str(kv[0]))
    ]


def _coverage(tests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op, provider and dtype: passed/total over the generated op checks and the sampler equivalence (ids ``op-provider-dtype``)."""
    cells: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    for t in tests:
        if not t["id"].startswith(OP_TESTS) or "[" not in t["id"]:
            continue
        param = t["id"].split("[", 1)[1].rstrip("]")
        head, _, dtype = param.rpartition("-")
        op, _, provider = head.partition("-")
        if not (op and provider and dtype):
            continue
        cell = cells[(op, provider, dtype)]
        cell[0] += t["state"] == "passed"
        cell[1] += 1
    return [
        {"op": o, "provider": p, "dtype": d, "passed": c[0], "total": c[1]} for (o, p, d), c in sorted(cells.items())
    ]


def _summary(tests: list[dict[str, Any]]) -> dict[str, int]:
    counts = {s: 0 for s in STATES}
    for t in tests:
        counts[t["state"]] = counts.get(t["state"], 0) + 1
    return {"total": len(tests), **counts}


def scope_of(device_type: str | None, device_count: int, devices: int | None) -> dict[str, Any]:
    """What a certification covers: the devices it is for and the ranks the comm checks run on.

    :param devices: ``--devices``, or ``None`` for every device the probe found.
    :raises ValueError: for a ``devices`` the platform cannot give.
    """
    from .comm_ranks import WORLD_SIZE, comm_world_size

    ranks = comm_world_size(device_type or "cpu", device_count, devices) if device_count else 0
    full = ranks >= WORLD_SIZE
    count = devices if devices is not None else device_count
    return {
        "devices": count,
        "devices_found": device_count,
        "devices_requested": devices,
        "comm_ranks": ranks,
        "full": full,
        "label": "full" if full else "no device" if not ranks else f"{count} device" + ("s" if count != 1 else ""),
    }


def _verdict(
    device: dict[str, Any],
    tests: list[dict[str, Any]],
    scope: dict[str, Any] | None,
    selection: list[str] | None = None,
    vllm: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """The verdict and its reason; ``selection``: the ``--check`` IDs of a partial run (never a certificate);
    ``vllm``: the stage inside vLLM (:mod:`.inside_vllm`), which refuses a plugin the suite passed."""
    if device.get("error"):
        return "not certified", f"the plugin did not load: {device['error']}"
    if not device.get("available"):
        return "could not run", f"device absent: {device.get('reason', '')}"
    if not tests:
        return "not certified", "no checks ran"
    limited = scope is not None and not scope.get("full", True)
    scoped = [t for t in tests if t["state"] == OUT_OF_SCOPE and limited and t["id"].startswith(SCOPED_TESTS)]
    bad = [t for t in tests if t["state"] not in ("passed", "waived") and t not in scoped]
    if bad:
        kinds = _summary(bad)
        said = ", ".join(f"{n} {s.replace('_', ' ')}" for s, n in kinds.items() if s != "total" and n)
        return "not certified", f"{said} (every required check must pass or be waived)"
    failed_inside_vllm = inside_vllm.failure(vllm or {})
    if failed_inside_vllm:
        return (
            "not certified",
            f"the suite passed, but inside vLLM (the bridge against vLLM alone): {failed_inside_vllm}",
        )
    if selection:
        return "not certified", (
            f"a partial run: the {len(tests)} checks selected by --check passed or were waived; "
            "a certificate needs the whole suite (certify without --check)"
        )
    if scoped:
        return "certified", (
            f"all {len(tests) - len(scoped)} checks in scope passed or waived; {len(scoped)} multi-device checks "
            f"out of scope: certified for {scope['label']}"  # type: ignore[index]
        )
    return "certified", f"all {len(tests)} checks passed or waived"


def headline(report: dict[str, Any]) -> str:
    """The verdict with its scope: ``certified``, ``certified for 1 device``, ``not certified``..."""
    scope = report.get("scope") or {}
    if report.get("verdict") == "certified" and scope and not scope.get("full", True):
        return f"certified for {scope['label']}"
    return str(report.get("verdict"))


def _first_probe(tests: list[dict[str, Any]], record: Any, limit_s: float) -> dict[str, Any]:
    """The first probe of a fresh process: measured by the suite's own discovery (its process is new)."""
    for t in tests:
        props = t.get("properties") or {}
        if "first_probe_s" in props:
            took, limit = props["first_probe_s"], props.get("probe_limit_s", limit_s)
            return {
                "first_probe_s": took,
                "limit_s": limit,
                "measured_in": "the suite's fresh process, by its discovery",
            }
    return {"first_probe_s": record.probe_s, "limit_s": limit_s, "measured_in": "certify's discovery"}


def _run_suite(
    plugin: str,
    record_file: Path,
    target: str = SUITE,
    devices: int | None = None,
    checks: list[str] | None = None,
    progress: ProgressLine | None = None,
) -> tuple[list[dict[str, Any]], int, list[str]]:
    """Run the suite (or the checks of ``target``) on ``plugin`` in a fresh process; its tests, exit status and command.

    :param checks: ``--check`` IDs: run only the checks whose id contains one of them.
    :param progress: where to show the checks done while the suite runs (``None``: nowhere).
    :raises ValueError: when one of ``checks`` selects none of the checks collected.
    :raises RuntimeError: when the suite did not run at all.
    """
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "vllm_port_conformance.recorder",
        "--pyargs",
        target,
        "--vllm-port-plugin",
        plugin,
        RECORD_OPTION,
        str(record_file),
        *([DEVICES_OPTION, str(devices)] if devices is not None else []),
        *(f"{CHECK_OPTION}={check}" for check in checks or ()),  # one word: a check may start with "-"
    ]
    env = {**os.environ, "PYTHONHASHSEED": str(SEED)}
    progress_file = record_file.with_name(record_file.name + ".progress")
    if progress is not None:
        env[PROGRESS_ENV] = str(progress_file)  # not on the command line: the report's command stays the suite's
    with tempfile.TemporaryDirectory() as cwd:  # no project's pytest configuration applies
        returncode, stdout, stderr = _follow(cmd, cwd, env, ProgressFile(progress_file, progress) if progress else None)
    if not record_file.is_file():
        raise RuntimeError(f"the suite did not run (exit {returncode}):\n{stdout[-3000:]}{stderr[-3000:]}")
    data = json.loads(record_file.read_text())
    if data.get("unmatched_checks"):
        raise ValueError(_unmatched_text(plugin, target, data["unmatched_checks"], data.get("collected", 0)))
    return data["tests"], returncode, cmd


def _follow(cmd: list[str], cwd: str, env: dict[str, str], progress: ProgressFile | None) -> tuple[int, str, str]:
    """Run ``cmd`` to its end, showing its progress file's news meanwhile; its exit status, stdout and stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # S603: this interpreter running pytest on an installed plugin's name, no shell
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True)  # noqa: S603
        try:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if progress is not None:
                        progress.poll()
        except BaseException:  # Ctrl-C: the suite goes with this process
            proc.kill()
            proc.wait()
            raise
        finally:
            if progress is not None:
                progress.poll()
                progress.line.close()
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read()


def _check_installed(plugin: str) -> None:
    """Refuse a ``plugin`` that names no installed plugin, listing those that are.

    :raises vllm_port.errors.SelectionError: naming ``plugin`` and the installed plugins.
    """
    from vllm_port.api import ENTRY_POINT_GROUP
    from vllm_port.errors import SelectionError

    installed = sorted({ep.name for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)})
    if plugin not in installed:
        raise SelectionError(
            f"unknown plugin {plugin!r} (the plugin to certify): no installed plugin is called that; installed "
            f"plugins: {', '.join(installed) or 'none'}. Name one of them, or pip install the plugin's distribution"
        )


def _unmatched_text(plugin: str, target: str, unmatched: list[str], collected: int) -> str:
    checks = ", ".join(repr(c) for c in unmatched)
    ran = "" if target == SUITE else f" (the plugin did not load: only {target} ran)"
    return (
        f"--check {checks} selects none of the {collected} checks of the suite on plugin {plugin!r}{ran}; "
        "give a check id as report.json lists it (e.g. 'test_memory::test_double_free_is_refused') or a part of one"
    )


def certify(
    plugin: str,
    waivers_file: Path | None = None,
    argv: list[str] | None = None,
    devices: int | None = None,
    checks: list[str] | None = None,
    progress: ProgressLine | None = None,
    vllm: str = "auto",
) -> dict[str, Any]:
    """Run the suite on ``plugin`` and return the report (with its digest).

    :param devices: certify for this many devices (``--devices``); every device found when ``None``.
    :param checks: ``--check`` IDs: a partial run of the checks whose id contains one of them.
    :param progress: where to show the checks done while the suite runs (``None``: nowhere).
    :param vllm: the stage inside vLLM (one of :data:`.inside_vllm.MODES`): ``auto`` runs it where vLLM and
        the bridge are installed, ``skip`` never, ``require`` refuses to start without them.
    :raises vllm_port.errors.SelectionError: when no installed plugin is called ``plugin``.
    :raises ValueError: for a ``devices`` the platform cannot give, a check that selects nothing, an unknown
        ``vllm`` mode, or ``require`` where vLLM or the bridge is missing.
    """
    from vllm_port.discovery import discover

    _check_installed(plugin)
    if vllm not in inside_vllm.MODES:
        raise ValueError(f"--vllm {vllm!r}: say one of {', '.join(inside_vllm.MODES)}")
    absent = inside_vllm.missing()
    if vllm == "require" and absent:
        raise ValueError(
            f"--vllm require: {absent}; install vLLM and vllm-port-vllm beside the plugin (docs/vllm-bridge.md), "
            "or certify without the stage inside vLLM (--vllm auto or skip)"
        )
    start = time.perf_counter()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    found = discover(plugins=plugin)
    record = next(r for r in found.plugins if r.name == plugin)
    device = _fingerprint(record)
    desc, probe = record.description, record.probe
    scope = scope_of(desc.device_type if desc else None, probe.device_count if probe else 0, devices)
    waivers = load_waivers(waivers_file, plugin)
    tests: list[dict[str, Any]] = []
    suite_cmd: list[str] = []
    if record.available or record.error is not None:  # a plugin that did not load is checked by what says why
        target = SUITE if record.available else LOAD_CHECKS
        with tempfile.TemporaryDirectory() as tmp:
            tests, _, suite_cmd = _run_suite(plugin, Path(tmp) / "record.json", target, devices, checks, progress)
        by_id = {w.test: w for w in waivers}
        for t in tests:
            w = by_id.get(t["id"])
            if w is not None and t["state"] != "passed":
                t["message"] = f"waived ({w.reason}); was {t['state']}: {t['message']}"
                t["state"] = "waived"
    selection = list(checks) if checks else None
    verdict, reason = _verdict(device, tests, scope, selection)
    stage_why = _why_not_inside_vllm(vllm, absent, verdict, selection)
    packages = run_packages(plugin, found) + ([inside_vllm.BRIDGE_PACKAGE] if stage_why is None else [])
    report: dict[str, Any] = {
        "report_version": REPORT_VERSION,
        "plugin": {
            "name": plugin,
            "distribution": record.distribution,
            "version": record.version,
            "git": plugin_git(plugin),
        },
        "versions": {
            "vllm-port": _version("vllm-port"),
            "plugin": record.version or "unknown",
            "vllm-port-conformance": _version("vllm-port-conformance"),
            "torch": _version("torch"),
            "pytest": _version("pytest"),
            "hypothesis": _version("hypothesis"),
            "python": host.python_version(),
        },
        "git": _git(),
        "source": source_digest(packages, [r.distribution for r in found.plugins if r.error is None]),
        "device": device,
        "scope": scope,
        "selection": selection,
        "probe": _first_probe(tests, record, found.probe_timeout_s),
        "command": {"argv": argv if argv is not None else ["vllm-port", "certify", plugin], "suite": suite_cmd},
        "seeds": {
            "torch_generator": 0,
            "torch_global": SEED,
            "python_random": SEED,
            "PYTHONHASHSEED": SEED,
            "hypothesis": f"profile {HYPOTHESIS_PROFILE!r}: derandomize=True, no example database",
        },
        "tests": tests,
        "summary": _summary(tests),
        "coverage": _coverage(tests),
        "tolerances": _tolerances(),
        "waivers": [{"test": w.test, "reason": w.reason, "plugin": w.plugin or "*"} for w in waivers],
        "timing": {"started": started, "total_s": round(time.perf_counter() - start, 3)},
        "vllm": inside_vllm.not_run(stage_why or inside_vllm.UNDER_WAY),
        "verdict": verdict,
        "reason": reason,
    }
    report["digest"] = digest(report)
    if stage_why is None:
        report = _inside_vllm(report, plugin, device, tests, scope, start)
    return report


def _why_not_inside_vllm(mode: str, absent: str | None, verdict: str, selection: list[str] | None) -> str | None:
    """Why the stage inside vLLM does not run after the suite's ``verdict``, or ``None`` when it runs."""
    if mode == "skip":
        return "--vllm skip"
    if selection:
        return "a partial run (--check)"
    if verdict != "certified":
        return f"the suite did not certify the plugin ({verdict})"
    return absent


def _inside_vllm(
    report: dict[str, Any], plugin: str, device: dict[str, Any], tests: list[dict[str, Any]], scope: Any, start: float
) -> dict[str, Any]:
    """``report`` (a certificate of the suite's run) with the stage inside vLLM run on it: its ``vllm`` field,
    verdict, timing and digest anew."""
    stage_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        certificate = Path(tmp) / "report.json"
        certificate.write_text(json.dumps(report))
        result = inside_vllm.run(plugin, certificate)
    final = {**report, "vllm": result}
    final["verdict"], final["reason"] = _verdict(device, tests, scope, None, result)
    final["timing"] = {
        **report["timing"],
        "vllm_s": round(time.perf_counter() - stage_start, 3),
        "total_s": round(time.perf_counter() - start, 3),
    }
    final["digest"] = digest(final)
    return final


def verify(report: Any) -> list[str]:
    """What is wrong with a report (edited, incomplete, inconsistent); empty when it holds."""
    if not isinstance(report, dict):
        return ["the report is not a JSON object"]
    required = REQUIRED_KEYS + (REQUIRED_KEYS_V3 if _version_of(report) >= 3 else ())
    required += REQUIRED_KEYS_V5 if _version_of(report) >= 5 else ()
    required += REQUIRED_KEYS_V6 if _version_of(report) >= 6 else ()
    problems = [f"missing key {k!r}" for k in required if k not in report]
    if _version_of(report) >= 4:
        about = report.get("plugin") if isinstance(report.get("plugin"), dict) else {}
        problems += [f"missing key 'plugin.{k}'" for k in PLUGIN_KEYS_V4 if k not in about]
    if report.get("digest") != digest(report):
        problems.append("digest mismatch: the report was edited after it was written")
    tests = report.get("tests")
    if not isinstance(tests, list):
        return [*problems, "'tests' is not a list"]
    malformed = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or not {"id", "state", "duration_s", "message"} <= set(t):
            malformed.append(f"incomplete: test {i} lacks id, state, duration_s or message")
        elif t["state"] not in STATES:
            malformed.append(f"test {t['id']!r} is in state {t['state']!r}, not one of {', '.join(STATES)}")
    if malformed:
        return problems + malformed
    expected, summary = _summary(tests), report.get("summary")
    if _version_of(report) < 3 and isinstance(summary, dict) and not expected[OUT_OF_SCOPE]:
        expected.pop(OUT_OF_SCOPE)  # reports before version 3 had no such state
        summary = {k: v for k, v in summary.items() if k != OUT_OF_SCOPE}
    if summary != expected:
        problems.append(f"incomplete: summary {report.get('summary')} does not match the {len(tests)} tests listed")
    device = report.get("device") or {}
    scope = report.get("scope") if _version_of(report) >= 3 else None
    if scope is not None:
        problems += _scope_problems(device, scope)
    selection = report.get("selection") if _version_of(report) >= 5 else None
    stage = report.get("vllm") if _version_of(report) >= 6 else None
    if stage is not None and not isinstance(stage, dict):
        return [*problems, "'vllm' is not an object"]
    verdict, _ = _verdict(device, tests, scope, selection, stage)
    if report.get("verdict") != verdict:
        problems.append(f"verdict {report.get('verdict')!r} is inconsistent with the results ({verdict!r})")
    return problems


def _version_of(report: dict[str, Any]) -> int:
    version = report.get("report_version")
    return version if isinstance(version, int) else 0


def _scope_problems(device: dict[str, Any], scope: Any) -> list[str]:
    """A scope that does not follow from the device the report names and the devices asked for."""
    if not isinstance(scope, dict):
        return ["'scope' is not an object"]
    found = len(device.get("devices") or [])
    try:
        want = scope_of(device.get("device_type"), found, scope.get("devices_requested"))
    except (TypeError, ValueError) as exc:
        return [f"scope {scope} is impossible on the device the report names: {exc}"]
    if scope != want:
        return [f"scope {scope} does not follow from the {found} device(s) the report names (expected {want})"]
    return []


def render(report: dict[str, Any]) -> str:
    """report.md: the report for people."""
    s, d = report["summary"], report["device"]
    scope, first = report.get("scope") or {}, report.get("probe") or {}
    lines = [
        f"# vllm-port certification: {report['plugin']['name']}",
        "",
        f"**Verdict: {headline(report)}** ({report['reason']})",
        "",
        f"{s['total']} checks: {s['passed']} passed, {s['failed']} failed, {s['error']} error, "
        f"{s['skipped']} skipped, {s['waived']} waived, {s.get(OUT_OF_SCOPE, 0)} out of scope; "
        f"{report['timing']['total_s']} s (started {report['timing']['started']}).",
        "",
        _scope_line(scope, len(d["devices"])),
        "",
        *(_selection_lines(report.get("selection"))),
        f"First probe of a fresh process: {first.get('first_probe_s')} s (limit {first.get('limit_s')} s; "
        f"measured in {first.get('measured_in', 'n/a')}).",
        "",
        "## Versions",
        "",
        "| component | version |",
        "| --- | --- |",
        *(f"| {k} | {v} |" for k, v in report["versions"].items()),
        f"| git commit | {_commit_text(report['git'])} |",
        *(
            [f"| {report['plugin']['distribution']} commit | {_commit_text(report['plugin']['git'])} |"]
            if "git" in report["plugin"]
            else []
        ),
        f"| source sha256 | {report['source']['sha256']} ({report['source']['files']} files of "
        f"{', '.join(report['source']['packages'])}"
        + (
            f"; distributions {', '.join(report['source']['distributions'])}"
            if report["source"].get("distributions")
            else ""
        )
        + ") |",
        "",
        "## Device",
        "",
        f"Platform `{d['platform']}` ({d['device_type']}), available: {d['available']} ({d['reason']}); "
        f"driver: {d['driver'] or 'n/a'}.",
        "",
        *(f"- {dev['name']}: {dev['total_memory']} bytes, arch `{dev['arch']}`" for dev in d["devices"]),
        "",
        "Capabilities: " + (", ".join(f"`{k}={v}`" for k, v in sorted(d["capabilities"].items())) or "none"),
        "",
        "## Command",
        "",
        "`"
        + shlex.join(report["command"]["argv"])
        + "`; seeds: "
        + ", ".join(f"{k}={v}" for k, v in report["seeds"].items()),
        "",
        *_vllm_lines(report.get("vllm")),
        "## Op coverage (checks passed / run, per provider and dtype)",
        "",
        "| op | provider | dtype | passed |",
        "| --- | --- | --- | --- |",
        *(f"| {c['op']} | {c['provider']} | {c['dtype']} | {c['passed']}/{c['total']} |" for c in report["coverage"]),
        "",
        "## Waivers",
        "",
        *([f"- `{w['test']}` ({w['plugin']}): {w['reason']}" for w in report["waivers"]] or ["none"]),
        "",
        "## Tolerances",
        "",
        "| op | dtype | atol | rtol | why |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {t['op']} | {t['dtype']} | {t['atol']} | {t['rtol']} | {t['reason']} |" for t in report["tolerances"]),
        "",
        "## Tests",
        "",
        "| test | state | s | message |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{t['id']}` | {t['state']} | {t['duration_s']:.3f} | "
            + t["message"].replace("|", "\\|").replace("\n", " ")[:300]
            + " |"
            for t in report["tests"]
        ),
        "",
        f"Digest: `{report['digest']}` (`vllm-port certify --verify report.json`)",
        "",
    ]
    return "\n".join(lines)


def _vllm_lines(stage: dict[str, Any] | None) -> list[str]:
    """The report's section on the stage inside vLLM (nothing for a report before version 6)."""
    if stage is None:
        return []
    lines = ["## Inside vLLM", ""]
    if not stage.get("ran"):
        return [*lines, f"Not run: {stage.get('why')}.", ""]
    lines += _model_lines(stage, "a tiny Llama")
    if stage.get("moe"):  # reports before the mixture of experts joined the stage have none
        lines += _model_lines(stage["moe"], f"a mixture of experts ({stage['moe'].get('model', 'tiny-mixtral')})")
    return lines


def _model_lines(result: dict[str, Any], model: str) -> list[str]:
    """One model's check inside vLLM: its verdict and a row per mode."""
    if result.get("error"):
        return [f"{model}: **FAIL**: {result['error']}", ""]
    lines = [
        f"vLLM {result.get('vllm_version', '?')}, {model} ({result.get('dtype')}), the bridge on this plugin's "
        f"kernels against vLLM alone; tolerance atol {result.get('atol')}, rtol {result.get('rtol')}: "
        f"**{'PASS' if result.get('ok') else 'FAIL'}**.",
        "",
        "| mode | worst logprob / tolerance (prompts, steps) | greedy ids equal | near-ties | bridged ops called |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode, m in sorted((result.get("modes") or {}).items()):
        ties = ", ".join(f"request {d['request']} step {d['step']} gap {d['gap']:.3g}" for d in m["divergences"])
        calls = ", ".join(f"{op} {n}" for op, n in sorted(m["calls"].items()))
        lines.append(
            f"| {mode} | {m['worst_prefill']:.3g}, {m['worst_decode']:.3g} | {m['equal_requests']}/{m['requests']} "
            f"| {ties or 'none'} | {calls} |"
        )
    return [*lines, ""]


def _selection_lines(selection: list[str] | None) -> list[str]:
    if not selection:
        return []
    checks = ", ".join(f"`{c}`" for c in selection)
    return [f"Partial run (`--check`), not a certificate: only the checks whose id contains {checks}.", ""]


def _commit_text(git: dict[str, Any]) -> str:
    commit, dirty = git.get("commit", "not recorded"), git.get("dirty", "not recorded")
    return f"{commit} (dirty: {dirty}" + (f"; from {git['from']}" if "from" in git else "") + ")"


def _scope_line(scope: dict[str, Any], found: int) -> str:
    if not scope:
        return f"Scope: not recorded (a report before version 3); {found} device(s) found."
    if not scope["comm_ranks"]:
        return "Scope: no device ran the checks."
    line = (
        f"Scope: {scope['label']}: {scope['devices']} device(s) in scope ({scope['devices_found']} found), "
        f"comm checks on {scope['comm_ranks']} rank(s)"
    )
    return line + ("; the multi-device checks are out of scope." if not scope["full"] else ".")


def main(
    plugin: str | None,
    report_dir: str | None,
    as_json: bool,
    waivers: str | None,
    verify_path: str | None,
    devices: int | None = None,
    checks: list[str] | None = None,
    vllm: str = "auto",
) -> int:
    """The ``vllm-port certify`` command; returns the exit status.

    :param checks: ``--check`` IDs (a partial run), or ``None``/empty for the whole suite.
    :param vllm: the stage inside vLLM: ``auto``, ``skip`` or ``require`` (:data:`.inside_vllm.MODES`).
    """
    if verify_path is not None:
        try:
            loaded = json.loads(Path(verify_path).read_text())
        except (OSError, ValueError) as exc:
            print(f"report rejected: cannot read {verify_path}: {exc}")
            return 1
        problems = verify(loaded)
        if problems:
            print(f"report rejected: {verify_path}:\n" + "\n".join(f"  - {p}" for p in problems))
            return 1
        print(f"report verified: {loaded['plugin']['name']}: {headline(loaded)} ({loaded['digest']})")
        if loaded.get("scope"):
            sc = loaded["scope"]
            print(f"scope: {sc['label']} ({sc['devices']} device(s), comm checks on {sc['comm_ranks']} rank(s))")
        about = loaded.get("plugin") or {}
        if isinstance(about.get("git"), dict):
            print(f"plugin: {about['distribution']} {about['version']} at commit {_commit_text(about['git'])}")
        if _version_of(loaded) < SOURCE_DIGEST_SINCE:
            print(
                f"source: not comparable: report version {_version_of(loaded)} hashed only the packages' .py files"
                f" (since version {SOURCE_DIGEST_SINCE} every file counts); certify again to tie it to these sources"
            )
        else:
            here = source_digest(loaded["source"]["packages"])["sha256"]
            same = here == loaded["source"]["sha256"]
            print(f"source: {'the same as' if same else 'differs from'} the packages installed here (sha256 {here})")
        return 0
    if not plugin:
        print(
            "error: name the plugin to certify (e.g. vllm-port certify cpu), or --verify report.json", file=sys.stderr
        )
        return 2
    from vllm_port.errors import SelectionError

    try:
        argv = ["vllm-port", "certify", plugin]
        argv += ["--report", report_dir] if report_dir else []
        argv += ["--waivers", waivers] if waivers else []
        argv += ["--devices", str(devices)] if devices is not None else []
        argv += [arg for check in checks or () for arg in ("--check", check)]
        argv += ["--vllm", vllm] if vllm != "auto" else []
        argv += ["--json"] if as_json else []
        # on stderr: a terminal sees one line updated in place, a log a line now and then, stdout only the report
        progress = ProgressLine(f"certify {plugin}")
        report = certify(plugin, Path(waivers) if waivers else None, argv, devices, checks, progress, vllm)
    except SelectionError as exc:  # an unknown PLUGIN, or a VLLM_PORT_* setting discovery refuses: said by exc
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if report_dir:
        out = Path(report_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        (out / "report.md").write_text(render(report))
    if as_json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        for t in report["tests"]:
            if t["state"] not in ("passed", "waived"):
                print(f"{t['state'].upper()} {t['id']}: {t['message']}")
        s = report["summary"]
        print(
            f"{s['total']} checks: {s['passed']} passed, {s['failed']} failed, {s['error']} error, "
            f"{s['skipped']} skipped, {s['waived']} waived, {s[OUT_OF_SCOPE]} out of scope"
        )
    status = {"certified": 0, "not certified": 1, "could not run": 2}[report["verdict"]]
    line = {"could not run": f"could not run: {report['reason']}"}.get(report["verdict"], headline(report))
    print(f"{plugin}: {line}" if status != 2 else line, file=sys.stderr if as_json else sys.stdout)
    if report_dir:
        print(f"report: {Path(report_dir) / 'report.json'}, {Path(report_dir) / 'report.md'}", file=sys.stderr)
    return status
