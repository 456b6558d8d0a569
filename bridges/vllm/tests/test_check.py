"""The comparison of ``python -m vllm_port_vllm.check``: tolerances, near-ties and calls (no vLLM needed)."""

from __future__ import annotations

import copy

from vllm_port_vllm.check import compare, tolerance
from vllm_port_vllm.runtime import BRIDGED_OPS

ATOL, RTOL = tolerance("float32")


def _run(ids: list[list[int]], steps: list[list[list[float]]]) -> dict:
    calls = {op: {"cpu/x": 3} for op in BRIDGED_OPS}
    prompt = [[[-1.0, -2.0, -3.0], [-0.5, -1.5, -9.0]]]
    return {"ids": ids, "logprobs": steps, "prompt_logprobs": prompt, "stats": calls}


ALONE = _run([[0, 1]], [[[-0.1, -2.0, -5.0], [-3.0, -0.2, -4.0]]])


def test_the_tolerance_is_the_least_strict_bridged_ops() -> None:
    assert (ATOL, RTOL) == (1e-4, 1e-4)  # the attention ops' float32 tolerance
    assert tolerance("bfloat16") == (0.015, 0.02)


def test_equal_runs_pass_and_a_difference_past_the_tolerance_fails() -> None:
    assert compare(ALONE, copy.deepcopy(ALONE), ATOL, RTOL)["ok"]
    off = copy.deepcopy(ALONE)
    off["prompt_logprobs"][0][1][2] += 10 * (ATOL + RTOL * 9.0)
    report = compare(ALONE, off, ATOL, RTOL)
    assert not report["ok"] and report["worst_prefill"] > 1


def test_a_differing_id_passes_only_at_a_near_tie() -> None:
    tied = _run([[0, 1]], [[[-0.69315, -0.69320, -5.0], [-3.0, -0.2, -4.0]]])
    flipped = _run([[1, 1]], [[[-0.69316, -0.69314, -5.0], [-3.0, -0.2, -4.0]]])
    report = compare(tied, flipped, ATOL, RTOL)
    (d,) = report["divergences"]
    assert report["ok"] and d["tie"] and d["step"] == 0 and d["gap"] < d["tie_bound"]
    wide = _run([[1, 1]], [[[-0.1, -0.05, -5.0], [-3.0, -0.2, -4.0]]])
    assert not compare(ALONE, wide, ATOL, RTOL)["ok"]  # vLLM alone preferred id 0 by 1.9: no tie


def test_a_bridged_op_never_called_fails() -> None:
    bridged = copy.deepcopy(ALONE)
    bridged["stats"]["paged_attention"] = {"cpu/x": 0}
    report = compare(ALONE, bridged, ATOL, RTOL)
    assert not report["ok"] and report["uncalled"] == ["paged_attention"]
