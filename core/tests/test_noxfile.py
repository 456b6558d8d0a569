"""noxfile.py has the sessions the README names, and ``nox -s conformance -- NAME PACKAGE`` certifies a plugin
installed from outside this repository (run without nox: the session functions get a stand-in session)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import nox  # noqa: F401 - a dev requirement (dev/requirements.txt): the sessions register with it
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sessions() -> dict[str, Any]:
    """The sessions noxfile.py registers, by name, as ``nox -l`` lists them."""
    from nox import registry

    runpy.run_path(str(ROOT / "noxfile.py"))
    return dict(registry.get())


class FakeSession:
    """What a session function calls on nox's session: its arguments, installs and commands are recorded."""

    def __init__(self, *posargs: str) -> None:
        self.posargs = list(posargs)
        self.installed: list[tuple[str, ...]] = []
        self.ran: list[tuple[str, ...]] = []

    def install(self, *args: str) -> None:
        self.installed.append(args)

    def run(self, *args: str) -> None:
        self.ran.append(args)

    def error(self, message: str) -> None:
        raise SystemExit(message)


def test_every_nox_session_the_readme_names_exists(sessions: dict[str, Any]) -> None:
    named = set(re.findall(r"nox -s ([\w-]+)", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert {"tests", "lint", "conformance-cpu", "conformance"} <= named
    assert named <= set(sessions), f"README names sessions noxfile.py lacks: {named - set(sessions)}"
    assert {f"conformance-{p}" for p in ("cpu", "cuda", "rocm", "xpu")} <= set(sessions)


def test_an_in_tree_session_certifies_its_plugin(sessions: dict[str, Any]) -> None:
    fake = FakeSession("--devices", "1")
    sessions["conformance-cuda"].func(fake)
    assert ("-e", "plugins/vllm-port-cuda") in fake.installed
    assert fake.ran == [("vllm-port", "certify", "cuda", "--report", "reports/cuda", "--devices", "1")]


def test_the_conformance_session_installs_and_certifies_a_plugin_from_outside(sessions: dict[str, Any]) -> None:
    fake = FakeSession("mychip", "../vllm-port-mychip", "dist/extra.whl", "--waivers", "w.toml")
    sessions["conformance"].func(fake)
    assert fake.installed[-1] == ("../vllm-port-mychip", "dist/extra.whl")  # after this repository's packages
    assert fake.ran == [("vllm-port", "certify", "mychip", "--report", "reports/mychip", "--waivers", "w.toml")]
    with pytest.raises(SystemExit, match="name the plugin"):
        sessions["conformance"].func(FakeSession())
