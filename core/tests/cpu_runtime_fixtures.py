"""Fixtures shared by the test packages that run models on the CPU platform (engine, importer).

A package's ``conftest.py`` imports them (``from cpu_runtime_fixtures import cpu_runtime, one_thread``),
which registers them for that package only: ``one_thread`` is autouse, and must not reach other tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import vllm_port


@pytest.fixture(scope="session")
def cpu_runtime() -> vllm_port.Runtime:
    """The CPU platform, discovered once (an ``LLM`` takes it as ``device``)."""
    return vllm_port.load(plugins="cpu")


@pytest.fixture(autouse=True, scope="package")
def one_thread() -> Iterator[None]:
    """Tiny shapes gain nothing from a second thread, only its synchronisation (ruinous on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
