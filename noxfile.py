"""Sessions: ``nox -s tests``, ``nox -s conformance-cpu`` (and -cuda, -rocm, -xpu), ``nox -s lint``, ``nox -s bench``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint"]
nox.options.reuse_existing_virtualenvs = True

PACKAGES = [
    "core",
    "plugins/vllm-port-cpu",
    "plugins/vllm-port-cuda",
    "plugins/vllm-port-rocm",
    "plugins/vllm-port-xpu",
    "conformance",
]
PLUGINS = ["cpu", "cuda", "rocm", "xpu"]


def _install(session: nox.Session) -> None:
    session.install("-r", "dev/requirements.txt")
    for package in PACKAGES:
        session.install("-e", package)


@nox.session
def tests(session: nox.Session) -> None:
    """Every test of every package."""
    _install(session)
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
@nox.parametrize("plugin", PLUGINS, ids=PLUGINS)
def conformance(session: nox.Session, plugin: str) -> None:
    """Certify one installed plugin: ``nox -s conformance-cpu`` writes ``reports/cpu/report.{json,md}``."""
    _install(session)
    session.run("vllm-port", "certify", plugin, "--report", f"reports/{plugin}", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """The CPU dispatch and block-pool benchmarks; write docs/results/dispatch-cpu.json and pool-cpu.json."""
    _install(session)
    session.run("vllm-port", "bench", "dispatch", "--json", "docs/results/dispatch-cpu.json")
    session.run("vllm-port", "bench", "pool", "--json", "docs/results/pool-cpu.json")
