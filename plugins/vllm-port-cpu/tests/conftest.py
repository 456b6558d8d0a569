"""Fixtures shared by the CPU plugin's tests of its native library."""

from __future__ import annotations

import pytest

from vllm_port_cpu import native


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """The native module as in a new process, building into an empty cache directory (``tmp_path``)."""
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "status", "not built yet")
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    native._library_name.cache_clear()
    yield tmp_path
    native._library_name.cache_clear()  # names keyed by a patched source or compiler go with the test
