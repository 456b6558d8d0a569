"""The engine with a faulty provider bound: debug mode keeps every request right; without it the run stops
naming the plugin, the op and the way around it; strict mode stops rather than falling back."""

from __future__ import annotations

import functools

import pytest
from cpu_providers import cpu_provider

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.errors import ProviderError

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy", "Elizabeth said", "The sea"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def generate(runtime: vllm_port.Runtime) -> tuple[list[list[int]], LLM]:
    llm = LLM(device=runtime, kv_cache_memory=4 << 20)  # the bundled model
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


@functools.cache
def healthy_outputs() -> list[list[int]]:
    return generate(vllm_port.load(plugins="cpu", device="cpu"))[0]


@pytest.mark.parametrize("fault", ["wrong values", "raises", "wrong shape"])
def test_debug_mode_quarantines_the_provider_and_every_request_finishes_right(
    faulty_runtime, fault, tmp_path, monkeypatch
):
    runtime = faulty_runtime(fault)
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")  # the default rate: each provider's first call, then 1 in 100
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    outputs, llm = generate(runtime)
    assert outputs == healthy_outputs()
    assert llm.runner.provider_per_op["rms_norm"] == cpu_provider("rms_norm")
    assert "provider 'zf_rms_norm' of plugin 'zfaulty'" in llm.runner.ops.fallbacks[0]
    assert len(list(tmp_path.glob("rms_norm-zf_rms_norm-*.json"))) == 1


def test_without_debug_mode_a_raising_provider_stops_the_run_naming_it(faulty_runtime):
    with pytest.raises(
        ProviderError, match=r"op 'rms_norm': provider 'zf_rms_norm' of plugin 'zfaulty' raised"
    ) as caught:
        generate(faulty_runtime("raises"))
    assert f"VLLM_PORT_OP_PROVIDERS=rms_norm={cpu_provider('rms_norm')}" in str(caught.value)


def test_strict_debug_mode_stops_instead_of_quarantining(faulty_runtime, tmp_path, monkeypatch):
    runtime = faulty_runtime("wrong values")
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    with pytest.raises(ProviderError, match="Strict mode .* forbids moving to the next provider"):
        generate(runtime)
