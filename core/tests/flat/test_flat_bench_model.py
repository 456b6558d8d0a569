"""``vllm-port bench model`` on a one-layer model: every mode that runs on CPU gives a row; capture is skipped."""

from __future__ import annotations

import json

import pytest

from vllm_port.cli import main


@pytest.mark.slow
def test_bench_model_runs_the_modes_and_writes_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "model.json"
    args = ["bench", "model", "--device", "cpu", "--layers", "1", "--batches", "1,3", "--context", "40", "--fast"]
    args += ["--json", str(out)]
    assert main([*args, "--modes", "eager,captured,hf-eager", "--dtype", "float32"]) == 0
    result = json.loads(out.read_text())
    rows = {(r["mode"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {(m, b) for m in ("eager", "captured", "hf-eager") for b in (1, 3)}
    assert "no graph capture" in rows[("captured", 1)]["skipped"]
    for mode in ("eager", "hf-eager"):
        assert rows[(mode, 3)]["ms"] > 0 and rows[(mode, 3)]["tokens_per_s"] > 0
        assert 0 < rows[(mode, 1)]["bandwidth_utilisation"] < 10
    assert result["fusions"]["fused_add_rms_norm"] == 2 and result["copy_gbs"] > 0
    assert "| eager |" in capsys.readouterr().out
    assert main([*args, "--modes", "turbo"]) == 2
