"""``bench engine --mixed-requests``: the mixed workload's lengths, and both of its runs over the same requests."""

from __future__ import annotations

import pytest
from calling_capture import CallingCapture

from vllm_port.bench.mixed_load import mixed_lengths, render, run_mixed


def test_lengths_are_long_tailed_bounded_and_repeat_with_the_seed():
    lengths = mixed_lengths(2000, 512, 256, seed=3)
    assert lengths == mixed_lengths(2000, 512, 256, seed=3) != mixed_lengths(2000, 512, 256, seed=4)
    prompts, outputs = sorted(p for p, _ in lengths), sorted(o for _, o in lengths)
    assert 4 <= prompts[0] and prompts[-1] <= 1024 and 1 <= outputs[0] and outputs[-1] <= 512
    assert 100 <= prompts[1000] <= 160 and 50 <= outputs[1000] <= 80  # medians a quarter of the typical lengths
    assert prompts[1980] > 5 * prompts[1000]  # the tail: p99 several times the median


@pytest.mark.slow
def test_both_runs_generate_every_token_and_count_their_steps(llama_model, cpu_runtime, monkeypatch):
    monkeypatch.setattr(cpu_runtime, "graph_capture", CallingCapture)
    mixed = run_mixed(
        llama_model, 512, "float32", 12, 24, 8, cpu_runtime, max_num_seqs=4, max_num_batched_tokens=16, block_size=4
    )
    replayed, eager = mixed["runs"]["prefill replayed"], mixed["runs"]["decode replayed only"]
    expected = sum(o for _, o in mixed_lengths(12, 24, 8))
    assert replayed["output_tokens"] == eager["output_tokens"] == expected
    assert replayed["steps"].get("prefill replayed", 0) > 0 and "eager" not in replayed["steps"]
    assert "prefill replayed" not in eager["steps"] and eager["steps"]["eager"] > 0
    assert replayed["itl_p50_ms"] > 0 and replayed["itl_p99_ms"] >= replayed["itl_p50_ms"]
    table = "\n".join(render(mixed))
    assert "| prefill replayed |" in table and "| decode replayed only |" in table
