"""Importer fixtures: tiny random ``transformers`` models of each family (``core/tests/models/tiny_models.py``)
and one CPU runtime for the session."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))

import vllm_port


@pytest.fixture(scope="session")
def cpu_runtime() -> vllm_port.Runtime:
    """The CPU platform, discovered once."""
    return vllm_port.load(plugins="cpu")


@pytest.fixture(autouse=True, scope="package")
def one_thread() -> Iterator[None]:
    """Tiny shapes gain nothing from a second thread, only its synchronisation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
