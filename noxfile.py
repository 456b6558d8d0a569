"""Sessions: ``nox -s tests``, ``nox -s conformance-cpu`` (and -cuda, -rocm, -xpu), ``nox -s conformance -- NAME [PACKAGE ...]``, ``nox -s lint``, ``nox -s bench``."""

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


def _certify(session: nox.Session, plugin: str, options: list[str]) -> None:
    session.run("vllm-port", "certify", plugin, "--report", f"reports/{plugin}", *options)


@nox.session
def tests(session: nox.Session) -> None:
    """Every test of every package."""
    _install(session)
    session.run("python", "-m", "pytest", *session.posargs)


def _in_tree_conformance(plugin: str) -> None:
    """Register ``conformance-PLUGIN`` (a name, not nox's ``conformance(PLUGIN)`` of a parametrized session)."""

    def certify_in_tree(session: nox.Session) -> None:
        _install(session)
        _certify(session, plugin, list(session.posargs))

    certify_in_tree.__doc__ = f"Certify the {plugin} plugin: reports/{plugin}/report.{{json,md}}."
    nox.session(name=f"conformance-{plugin}")(certify_in_tree)


for _plugin in PLUGINS:
    _in_tree_conformance(_plugin)


@nox.session
def conformance(session: nox.Session) -> None:
    """Certify any plugin, one from outside this repository too: ``nox -s conformance -- NAME [PACKAGE ...] [OPTION ...]``.

    PACKAGEs (a folder, a wheel, a requirement) are installed next to this repository's packages
    first; OPTIONs (``--waivers F``, ``--devices N``) go to ``vllm-port certify``. The report is
    ``reports/NAME/report.{json,md}``. Example: ``nox -s conformance -- mychip ../vllm-port-mychip``.
    """
    if not session.posargs or session.posargs[0].startswith("-"):
        session.error("name the plugin: nox -s conformance -- NAME [PACKAGE ...] (e.g. -- mychip ../vllm-port-mychip)")
    plugin, rest = session.posargs[0], list(session.posargs[1:])
    first_option = next((i for i, arg in enumerate(rest) if arg.startswith("-")), len(rest))
    packages, options = rest[:first_option], rest[first_option:]
    _install(session)
    if packages:
        session.install(*packages)
    _certify(session, plugin, options)


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
