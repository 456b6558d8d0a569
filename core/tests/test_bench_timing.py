"""The benchmarks' timing helpers: cold-cache timing and the two bandwidth ceilings."""

import torch

from vllm_port.bench import _timing
from vllm_port.bench.ops import _format_row

CPU = torch.device("cpu")


def test_cold_timing_times_each_call_alone_after_the_warm_up():
    calls = []
    ms = _timing.cold_median_ms(lambda: calls.append(1), CPU, repeat=5, warmup=2)
    assert 0 <= ms < 1.0 and len(calls) == 7


def test_ceilings_are_positive_and_counted_as_documented():
    copy, read = _timing.copy_bandwidth_gbs(CPU, 1 << 22), _timing.read_bandwidth_gbs(CPU, 1 << 22)
    assert copy > 0 and read > 0


def test_memory_bound_rows_show_both_ceilings_and_the_cold_time():
    row = {
        "op": "rms_norm", "tokens": 16, "impl": "cpu_rms_norm", "ms": 0.002, "timing": "launches",
        "cold_ms": 0.005, "gbs": 100.0, "fraction": 0.9, "fraction_of_read": 0.8,
    }  # fmt: skip
    line = _format_row(row)
    assert "90.0%" in line and "80.0%" in line and "5.0 us" in line and "2.0 us" in line
