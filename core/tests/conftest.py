"""Fixtures that install real test plugins (see plugin_factory.py), and the distributions' wheels and a torch venv (distributions.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from distributions import build_wheels, make_torch_venv
from plugin_factory import write_plugin


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A folder on sys.path (and PYTHONPATH, for subprocesses) where test plugins get installed."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))
    before = set(sys.modules)
    yield folder
    for module in set(sys.modules) - before:
        if module.startswith("vllm_port_test_"):
            del sys.modules[module]


@pytest.fixture
def install_plugin(site: Path) -> Callable[..., str]:
    """Install a test plugin: ``install_plugin("fake", source)``; ``healthy(platform, priority)`` builds a good one."""

    def install(name: str, source: str, version: str = "0.0.1") -> str:
        return write_plugin(site, name, source, version)

    return install


def _build_env() -> dict[str, str]:
    """This environment less what would let a build or a venv see the checkout or change its choices."""
    return {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("VLLM_PORT_")
    }


@pytest.fixture(scope="session")
def distribution_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every distribution's wheel (source folder -> wheel), built once a session (see distributions.py)."""
    return build_wheels(tmp_path_factory.mktemp("wheels"), _build_env())


@pytest.fixture(scope="session")
def torch_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding torch alone, made once a session, that the wheels' venvs see below them (see distributions.py)."""
    return make_torch_venv(tmp_path_factory.mktemp("torch") / "venv", _build_env())
