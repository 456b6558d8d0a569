"""Non-finite values are never an answer, and blame goes where the evidence is (issue 25).

Faulty providers installed for real (``faulty_plugins.py``): a ``linear`` that writes NaN into one
element every 11th call, an ``rms_norm`` every 7th, an ``embedding`` whose last table row reads as
NaN, a ``sample`` that returns an id past the vocabulary or a negative one. Every request either
finishes with the healthy run's tokens or with ``finish_reason == "error"`` after a prefix of them,
and the message names the step and, in debug mode, the op.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cpu_providers import cpu_provider

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.errors import OpInputError, ProviderError
from vllm_port.ops.debug import CheckConfig, blame, quarantined

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy", "Elizabeth said", "The sea"]
PARAMS = {
    "greedy": [SamplingParams(temperature=0, max_tokens=8)] * len(PROMPTS),
    "sampled": [SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=8) for i in range(len(PROMPTS))],
}
VOCAB = 4096  # the bundled model's


def generate(runtime: vllm_port.Runtime, mode: str, prompts=PROMPTS, **engine) -> tuple[list, LLM]:
    llm = LLM(device=runtime, kv_cache_memory=4 << 20, **engine)  # the bundled model
    return [o.outputs[0] for o in llm.generate(list(prompts), PARAMS[mode][: len(prompts)])], llm


@functools.cache
def healthy(mode: str, prompts: tuple[str, ...] = tuple(PROMPTS)) -> tuple[tuple[int, ...], ...]:
    outputs, _ = generate(vllm_port.load(plugins="cpu", device="cpu"), mode, prompts)
    return tuple(tuple(o.token_ids) for o in outputs)


def assert_right_or_error(outputs: list, mode: str, prompts=PROMPTS) -> list:
    """Every output is the healthy run's, or an error after a prefix of it; return the errored ones."""
    errors = []
    for out, want in zip(outputs, healthy(mode, tuple(prompts)), strict=True):
        assert all(0 <= t < VOCAB for t in out.token_ids)
        if out.finish_reason == "error":
            assert tuple(out.token_ids) == want[: len(out.token_ids)]
            errors.append(out)
        else:
            assert tuple(out.token_ids) == want
    return errors


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("fault", ["linear NaN every 11th", "rms_norm NaN every 7th"])
def test_nan_at_run_time_finishes_the_request_with_an_error_naming_the_step(faulty_runtime, fault, mode):
    outputs, llm = generate(faulty_runtime(fault), mode)
    errors = assert_right_or_error(outputs, mode)
    assert errors, "the NaN never reached a token"
    for out in errors:
        position = next(i for i, o in enumerate(outputs) if o is out)  # the request's place in the generate call
        assert out.error.startswith(f"request {position}: engine step ")
        assert "logits hold 4,096 NaN and 0 infinite value(s): no token can be drawn from them" in out.error
        assert "run with VLLM_PORT_CHECK=1 (debug mode)" in out.error
    assert llm.scheduler.pool.num_free == llm.scheduler.pool.num_blocks  # no block left behind


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("fault", ["linear NaN every 11th", "rms_norm NaN every 7th"])
def test_debug_mode_re_runs_the_step_and_names_the_op(faulty_runtime, fault, mode, tmp_path, monkeypatch):
    op = fault.split()[0]
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")  # the default share, 0.01: the NaN calls go unchecked
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    outputs, llm = generate(faulty_runtime(fault), mode)
    (error,) = assert_right_or_error(outputs, mode)  # quarantined at once: the other requests are right
    assert "engine step 1, " in error.error
    assert "debug mode re-ran the step comparing all " in error.error
    assert (
        f"the first at fault is op {op!r}: provider 'zf_{op}' of plugin 'zfaulty' disagrees with the float64 "
        "reference" in error.error
    )
    assert "got nan" in error.error and error.error.endswith("; quarantined")
    assert llm.runner.provider_per_op[op] == cpu_provider(op)


def test_a_row_of_nan_ends_only_its_request_and_its_blocks_are_not_cached(faulty_runtime):
    runtime = faulty_runtime("embedding NaN last row")
    llm = LLM(device=runtime, kv_cache_memory=4 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    poisoned = [5, 6, 7, 8] * 8 + [VOCAB - 1]  # two full blocks of 16 tokens, then the NaN row
    prompts = [PROMPTS[0], poisoned, PROMPTS[1]]
    first = [o.outputs[0] for o in llm.generate(prompts, greedy)]
    assert [o.finish_reason for o in first] == ["length", "error", "length"]
    assert "engine step 1, " in first[1].error and first[1].token_ids == []
    want = healthy("greedy")
    assert (tuple(first[0].token_ids), tuple(first[2].token_ids)) == (want[0], want[1])
    # the errored request's blocks are not kept for prefix caching: its prefix is computed afresh
    hits = llm.scheduler.pool.stats().hits
    again = llm.generate([[*poisoned[:-1], 9]], greedy)[0].outputs[0]
    assert again.finish_reason == "length" and llm.scheduler.pool.stats().hits == hits


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_nan_in_the_last_step_never_reaches_the_user(faulty_runtime, mode):
    llm = LLM(device=faulty_runtime("embedding NaN last row"), kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0 if mode == "greedy" else 0.8, seed=1, max_tokens=1)
    (out,) = llm.generate([[3, VOCAB - 1]], params)
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("error", [])


@pytest.mark.parametrize("fault", ["sample id past the vocabulary", "sample negative id"])
def test_a_samplers_bad_id_is_blamed_on_the_sampler(faulty_runtime, fault):
    outputs, _ = generate(faulty_runtime(fault), "sampled")
    errors = assert_right_or_error(outputs, "sampled")  # the bad id never reaches the user or the next step
    assert len(errors) == len(PROMPTS)  # the last row of every step: each request in turn
    bad = VOCAB if "past" in fault else -1
    for out in errors:
        assert (
            f"op 'sample': provider 'zf_sample' of plugin 'zfaulty' returned token id {bad} for this request, "
            f"outside the vocabulary [0, {VOCAB}). Run without it: VLLM_PORT_OP_PROVIDERS=sample=cpu_sample, "
            "or deny its plugin (VLLM_PORT_PLUGINS=-zfaulty)" in out.error
        )
        assert "embedding" not in out.error


@pytest.mark.parametrize("fault", ["linear NaN every 11th", "sample id past the vocabulary"])
def test_asynchronous_scheduling_feeds_no_bad_token_on(faulty_runtime, fault):
    """A step run ahead was fed its rows' ids before they were checked: a request whose row had NaN logits
    or a bad id still ends with an error after a prefix of the healthy tokens, and no bad id is fed on."""
    outputs, llm = generate(faulty_runtime(fault), "sampled", async_scheduling=True)
    errors = assert_right_or_error(outputs, "sampled")
    assert errors and all("engine step" in out.error for out in errors)
    assert llm._ahead is None


def test_a_samplers_bad_id_in_the_last_step_never_reaches_the_user(faulty_runtime):
    llm = LLM(device=faulty_runtime("sample id past the vocabulary"), kv_cache_memory=4 << 20)
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, seed=0, max_tokens=1))
    assert (out.outputs[0].finish_reason, out.outputs[0].token_ids) == ("error", [])
    assert "provider 'zf_sample'" in out.outputs[0].error


def test_a_sampler_returning_too_few_ids_is_named_before_any_is_read(faulty_runtime):
    with pytest.raises(ProviderError) as caught:
        generate(faulty_runtime("sample one id short"), "sampled")
    assert str(caught.value).startswith(
        "op 'sample': provider 'zf_sample' of plugin 'zfaulty' returned shape (3,), dtype torch.int64; the op returns "
        "int64 ids of shape [4]. Run without it: VLLM_PORT_OP_PROVIDERS=sample=cpu_sample"
    )
    assert (caught.value.op, caught.value.provider, caught.value.plugin) == ("sample", "zf_sample", "zfaulty")


@pytest.mark.parametrize("fault", ["sample id past the vocabulary", "sample negative id"])
def test_debug_mode_quarantines_the_sampler_not_the_embedding(faulty_runtime, fault, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    outputs, llm = generate(faulty_runtime(fault), "sampled")
    assert [tuple(o.token_ids) for o in outputs] == list(healthy("sampled"))
    assert llm.runner.provider_per_op["sample"] == "cpu_sample"
    assert llm.runner.provider_per_op["embedding"] == "cpu_embedding"
    (fallback,) = llm.runner.ops.fallbacks
    assert "op 'sample': provider 'zf_sample' of plugin 'zfaulty'" in fallback and "drew ids outside" in fallback


def test_debug_mode_blames_a_now_and_then_bad_sampler_and_leaves_the_embedding_in_service(
    faulty_runtime, tmp_path, monkeypatch
):
    monkeypatch.setenv("VLLM_PORT_CHECK", "on")  # the 3rd call, with the bad id, is not compared
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    outputs, llm = generate(faulty_runtime("sample id past the vocabulary every 3rd"), "sampled")
    errors = assert_right_or_error(outputs, "sampled")
    assert errors and all(
        "op 'sample': provider 'zf_sample' of plugin 'zfaulty' returned token id 4096" in o.error for o in errors
    )
    assert llm.runner.provider_per_op["embedding"] == "cpu_embedding"
    assert not any("embedding" in f for f in llm.runner.ops.fallbacks)


def test_debug_mode_does_not_quarantine_a_provider_whose_inputs_the_reference_refuses_too():
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    kernels = runtime.bind(torch.float32, check=CheckConfig(1.0))
    weight = torch.randn(16, 8)
    with pytest.raises(OpInputError) as caught:
        kernels.embedding(torch.tensor([3, 16]), weight)  # id 16 past the table: cpu_embedding raises IndexError
    message = str(caught.value)
    assert "op 'embedding': its inputs are at fault, not provider 'cpu_embedding' of plugin 'cpu'" in message
    assert "input_ids[1] is 16, outside [0, 16)" in message and "nothing is quarantined" in message
    assert quarantined(kernels.providers["embedding"]) is None
    assert kernels.providers["embedding"].name == "cpu_embedding" and not kernels.fallbacks
    assert torch.equal(kernels.embedding(torch.tensor([3]), weight), weight[3:4])  # still serving


def test_blame_names_no_provider_when_the_ops_input_check_refuses_the_inputs_too():
    kernels = vllm_port.load(plugins="cpu", device="cpu").bind(torch.float32, check=False)
    weight = torch.randn(16, 8)
    with pytest.raises(OpInputError) as caught, blame(kernels):
        kernels.embedding(torch.tensor([3, 16]), weight)  # cpu_embedding raises IndexError (values unchecked)
    message = str(caught.value)
    assert "op 'embedding': its inputs are at fault, not provider 'cpu_embedding' of plugin 'cpu'" in message
    assert (
        "the op's own input check refuses the arguments as the provider held them: embedding: input_ids[1] is 16"
        in message
    )
    assert not isinstance(caught.value, ProviderError) and isinstance(caught.value.__cause__, IndexError)
