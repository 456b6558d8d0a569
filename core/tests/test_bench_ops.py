"""``vllm-port bench ops``: bounded sizes on a CPU unless ``--full``, and progress as rows done of rows planned."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from cpu_providers import cpu_provider

from vllm_port.bench import ops as bench_ops


def test_cpu_runs_are_bounded_unless_full() -> None:
    assert bench_ops.token_counts("paged_attention", "cpu", 32768) == (1, 16)
    assert bench_ops.token_counts("paged_attention", "cpu", 32768, full=True) == (1, 16, 64, 256)
    assert bench_ops.token_counts("rms_norm", "cpu", 100) == (1, 16)  # --max-tokens still applies
    assert bench_ops.token_counts("prefill_attention", "cuda", 32768) == bench_ops.TOKENS["prefill"]
    assert set(bench_ops.CPU_TOKENS) == set(bench_ops.TOKENS)  # every family has its CPU bound


@pytest.mark.slow
def test_progress_counts_rows_done_of_rows_planned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # narrow widths and no Inductor peer, so the whole run takes a second; the plan and the count are the point
    monkeypatch.setattr(bench_ops, "HIDDEN", 64)
    monkeypatch.setattr(bench_ops, "VOCAB", 256)
    eager_peers = bench_ops._peers

    def peers(*args: Any) -> dict[str, Any]:
        return {k: v for k, v in eager_peers(*args).items() if "torch.compile" not in k}

    monkeypatch.setattr(bench_ops, "_peers", peers)
    result = bench_ops.run("cpu", torch.float32, ["rms_norm", "embedding"], max_tokens=16)
    lines = capsys.readouterr().out.splitlines()
    rows = 8 if cpu_provider("rms_norm") == "cpu_rms_norm" else 10  # the native rms_norm: a provider more, 2 sizes
    assert lines[0] == f"planned: {rows} rows (2 ops); CPU sizes bounded, --full times every size"
    progress = [re.match(rf"\[ *(\d+)/{rows}\] ", line) for line in lines[1:]]
    assert [int(m.group(1)) for m in progress if m] == list(range(1, rows + 1))
    assert result["bounded"] is True and len(result["rows"]) == rows


def test_plot_names_the_extra_when_matplotlib_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_ops.importlib.util, "find_spec", lambda name: None)
    assert bench_ops.main("cpu", "float32", "rms_norm", 1, None, "out.png") == 2
    assert "pip install 'vllm-port[plot]'" in capsys.readouterr().err
