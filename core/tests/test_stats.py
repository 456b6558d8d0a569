"""``VLLM_PORT_STATS=FILE``: every bound op counts its calls where its kernel runs, and each process adds its counts to FILE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_port.ops import stats
from vllm_port.runtime import load


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "stats.json"
    monkeypatch.setenv(stats.STATS_ENV, str(path))
    monkeypatch.setenv("VLLM_PORT_DEVICE", "cpu")
    return path


def test_eager_and_compiled_calls_are_counted_where_the_kernel_runs(counting: Path) -> None:
    runtime = load()
    eager, traced = runtime.bind(torch.float32), runtime.bind(torch.float32, traceable=True)
    who = f"{eager.providers['rms_norm'].plugin}/{eager.providers['rms_norm'].name}"
    before = stats.snapshot().get("rms_norm", {}).get(who, 0)
    x, w = torch.randn(3, 8), torch.ones(8)
    eager.rms_norm(x, w, 1e-6)
    compiled = torch.compile(lambda x: traced.rms_norm(x, w, 1e-6), fullgraph=True, backend="eager")
    compiled(x)
    compiled(x)  # the graph calls the custom op, whose real function counts: 3 calls, not 1 traced
    assert stats.snapshot()["rms_norm"][who] == before + 3
    assert stats.snapshot()["silu_and_mul"]  # every bound op is listed, called or not


@pytest.mark.slow  # two fresh interpreters importing torch
def test_processes_merge_their_counts_into_one_file(counting: Path) -> None:
    code = (
        "import torch; from vllm_port.runtime import load; k = load().bind(torch.float32); "
        "k.silu_and_mul(torch.randn(2, 8))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    written = json.loads(counting.read_text())
    assert len(written["processes"]) == 2
    (calls,) = written["calls"]["silu_and_mul"].values()
    assert calls == 2
    assert set(written["calls"]["rms_norm"].values()) == {0}  # bound, never called: listed with 0


def test_write_stats_writes_what_is_new_once(counting: Path) -> None:
    load().bind(torch.float32).gelu_and_mul(torch.randn(2, 8), "none")
    assert stats.write_stats() == counting
    first = json.loads(counting.read_text())
    assert stats.write_stats() is None  # nothing called since: the exit hook adds no second entry
    assert json.loads(counting.read_text()) == first


def test_without_the_setting_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(stats.STATS_ENV, raising=False)
    monkeypatch.setenv("VLLM_PORT_DEVICE", "cpu")
    kernels = load().bind(torch.float32)
    assert not getattr(kernels.rms_norm, "vllm_port_counted", False)
