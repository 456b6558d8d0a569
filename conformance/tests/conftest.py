"""Fixtures of the certification tests: the runs they share, each once per pytest run (see ``shared_runs``)."""

from __future__ import annotations

import pytest
from certify_helpers import Certified, run_certify
from shared_runs import CPU_CERTIFICATION, OncePerRun


def pytest_configure(config: pytest.Config) -> None:
    # also registered here for runs without pytest-xdist, which registers it itself
    config.addinivalue_line("markers", "xdist_group(name): under --dist loadgroup, run on one worker with its group")


@pytest.fixture(scope="session")
def once(tmp_path_factory: pytest.TempPathFactory) -> OncePerRun:
    """This pytest run's shared runs, in the temporary folder that all its xdist workers share."""
    return OncePerRun.for_run(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def cpu_certified(once: OncePerRun) -> Certified:
    """``vllm-port certify cpu --report DIR``: the whole suite on the CPU plugin, once per run (~40 CPU s)."""
    return once(CPU_CERTIFICATION, lambda folder: run_certify("cpu", report_dir=folder / "cpu"))
