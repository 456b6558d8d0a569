"""``vllm-port bench moe``: its shapes are the command's choices, and a CPU smoke run at the tiny shape writes its rows."""

from __future__ import annotations

import json

import pytest

from vllm_port.cli import main


def test_moe_shapes_are_the_benchmarks_shapes() -> None:
    from vllm_port.bench import moe
    from vllm_port.bench.bench_command import MOE_SHAPES

    assert list(MOE_SHAPES) == list(moe.SHAPES)


@pytest.mark.slow
def test_a_cpu_smoke_run_writes_a_row_per_token_count(tmp_path, capsys) -> None:
    out = tmp_path / "moe.json"
    argv = ["bench", "moe", "--device", "cpu", "--shape", "tiny", "--tokens", "1,3", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["provider"] == "cpu_fused_moe" and result["experts"] == 8
    rows = result["rows"]
    assert [(r["tokens"], r["impl"]) for r in rows] == [(1, "fused_moe"), (3, "fused_moe")]
    assert all(r["max_abs_error"] < 0.05 and r["us"] > 0 and r["gbs"] > 0 for r in rows)
    assert "fused_moe bound to cpu_fused_moe" in capsys.readouterr().out


def test_the_sweep_relaunches_the_bound_triton_kernels_with_torch_routing_and_each_tile() -> None:
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from vllm_port.bench.moe import SWEEP_TILES, _sweep
    from vllm_port.kernels.triton import INTERPRETER
    from vllm_port.kernels.triton.moe import MoeKernels

    bound = SimpleNamespace(providers={"fused_moe": SimpleNamespace(fn=MoeKernels(INTERPRETER).fused_moe)})
    found = _sweep(bound)
    torch_routed = found.pop("fused_moe, torch routing").__self__.target
    assert not torch_routed.moe_route_small and torch_routed.moe_small == INTERPRETER.moe_small
    assert len(found) == len(SWEEP_TILES)
    assert {fn.__self__.target.moe_large for fn in found.values()} == set(SWEEP_TILES)
    assert list(_sweep(bound, tiles=False)) == ["fused_moe, torch routing"]
    cpu = SimpleNamespace(providers={"fused_moe": SimpleNamespace(fn=lambda *a: None)})
    assert _sweep(cpu) == {}


def test_the_fp8_linear_benchmark_asks_the_platform_and_refuses_a_cpu_one(capsys):
    from vllm_port.bench import fp8_linear

    assert fp8_linear.main(device="cpu") == 2
    assert "the selected platform runs on the CPU" in capsys.readouterr().out
