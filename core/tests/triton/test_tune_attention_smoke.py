"""``dev/tune_attention.py --shipped``, issue 17's attention table, on tiny shapes in Triton's CPU interpreter.

The GPU run happens on a lent machine, a few times at most: here the same case construction, masks,
kernel calls (the CUDA plugin's providers), reference checks and verdicts run on CPU first, with
torch's math backend standing in for cuDNN and flash.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.skipif(
    not triton.knobs.runtime.interpret, reason="--smoke runs in Triton's CPU interpreter (GPU runs run the table)"
)

SCRIPT = Path(__file__).resolve().parents[3] / "dev" / "tune_attention.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    """``dev/tune_attention.py`` imported as a module (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("tune_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow
def test_smoke_checks_every_row_against_sdpa_and_aligns_the_prefix_mask(script, tmp_path, monkeypatch, capsys) -> None:
    """The prefix case and a decode case (the rest of --smoke differs only in sizes), in this process."""
    prefix = next(c for c in script.SMOKE_CASES if isinstance(c, script.PrefillCase) and c.prefix)
    decode = next(c for c in script.SMOKE_CASES if isinstance(c, script.DecodeCase))
    monkeypatch.setattr(script, "SMOKE_CASES", (prefix, dataclasses.replace(decode, block_sizes=(128,))))
    out = tmp_path / "table.json"
    assert script.main(["--shipped", "--smoke", "--json", str(out)]) == 0
    table = json.loads(out.read_text())
    rows = [(r["case"], r["block_size"], r["check"]) for r in table["prefill"] + table["decode"]]
    assert rows == [(prefix.label, 128, "ok"), (prefix.label, 16, "ok"), (decode.label, 128, "ok")]
    first = table["prefill"][0]
    # the math backend's is_causal is top-left aligned: refused on its values, the lower-right mask serves
    assert first["cudnn_note"].startswith("ran as causal_lower_right; not as is_causal: wrong values")
    assert first["us"] > 0 and first["cudnn_us"] > 0 and first["vs_flash"] > 0
    assert table["decode"][0]["flash_note"] == "ran as enable_gqa"
    # no graphs on CPU: the graph columns are empty and say "-" (not "n/a": nothing was tried)
    assert first["graph_read_us"] is None and first["cudnn_graph_read_us"] is None and first["vs_flash_graph"] is None
    prefill_table = capsys.readouterr().out.split("## Prefill")[1].split("## Decode")[0]
    ours_row = next(line for line in prefill_table.splitlines() if line.startswith(f"| {prefix.label} | 128 |"))
    assert "| - | - | - | - | - |" in ours_row and "n/a" not in ours_row


def test_verdicts_judge_issue_17s_goals(script) -> None:
    cases = (
        script.PrefillCase("p", 1, 8, cudnn_goal=0.9),
        script.DecodeCase("d", 1, 8, block_sizes=(128,), copy_goal=0.8),
    )
    results = [
        {
            "kind": "prefill",
            "case": "p",
            "flops": 1e6,
            "ours": [{"block_size": 128, "us": 100.0, "graph_read_us": 40.0, "check": "ok"}],
            "peers": {
                "cudnn": {"us": 89.0, "graph_read_us": 36.0, "formulation": "is_causal"},
                "flash": {"error": "n/a: refused"},
            },
        },
        {
            "kind": "decode",
            "case": "d",
            "bytes": 1000,
            "ours": [
                {"block_size": 128, "do_bench_us": 2.0, "graph_read_us": 1.0, "graph_write_us": 1.25, "check": "ok"}
            ],
            "peers": {},
        },
    ]
    (p,), (d,) = script.table_rows(results, 1.0, cases)
    assert (
        p["vs_cudnn"] == pytest.approx(0.89) and p["cudnn_verdict"] == "MISSED" and p["tflops"] == pytest.approx(0.01)
    )
    assert p["vs_flash"] is None and p["flash_verdict"] == "n/a" and p["flash_note"] == "n/a: refused"
    # the graph replays' ratio sits beside; the verdicts stay on do_bench's
    assert p["vs_cudnn_graph"] == pytest.approx(0.9) and p["graph_read_tflops"] == pytest.approx(0.025)
    assert p["vs_flash_graph"] is None
    # 1000 bytes in 1 us is 1 GB/s, the copy rate given; the write-flushed replay reaches 80%
    assert d["graph_read_of_copy"] == pytest.approx(1.0) and d["graph_write_of_copy"] == pytest.approx(0.8)
    assert d["copy_verdict"] == "met" and d["vs_cudnn"] is None


def test_prefill_graph_failures_read_n_a_with_the_reason(script, capsys) -> None:
    """On a GPU a capture that fails (ours or a peer's) leaves its do_bench row standing and says why."""
    cases = (script.PrefillCase("p", 1, 8),)
    cudnn = {"us": 50.0, "formulation": "is_causal", "graph_error": "RuntimeError: capture refused"}
    results = [
        {
            "kind": "prefill",
            "case": "p",
            "flops": 1e6,
            "ours": [{"block_size": 128, "us": 100.0, "graph_error": "RuntimeError: no capture", "check": "ok"}],
            "peers": {"cudnn": cudnn, "flash": {"us": 80.0, "graph_read_us": 30.0, "formulation": "is_causal"}},
        }
    ]
    (p,), _ = script.table_rows(results, 1.0, cases)
    assert p["vs_cudnn"] == pytest.approx(0.5) and p["vs_cudnn_graph"] is None and p["vs_flash_graph"] is None
    script.print_tables([p], [], 1.0, graphs=True)
    out = capsys.readouterr().out
    assert "| n/a | n/a | 30.0 us | n/a | n/a |" in out
    assert "ran as is_causal (graph timing failed: RuntimeError: capture refused)" in out
    assert "ours on 128-token blocks, graph: graph timing failed: RuntimeError: no capture" in out
