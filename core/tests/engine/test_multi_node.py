"""Tensor and pipeline parallelism across machines: two ``torchrun`` "nodes" on 127.0.0.1, one gloo rank each.

Each node is its own ``torchrun --nnodes 2 --node-rank R`` (static rendezvous at 127.0.0.1), as on two
machines; each runs ``vllm-port generate --distributed-executor-backend external_launcher``, a whole
engine per rank. Both must print the tokens one process generates alone (greedy), as two tensor-parallel
shards and as two pipeline stages, and stop together, naming the rank, when one of them is given another
prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from llm_helpers import make_llm, prompts, token_ids

from vllm_port import LLM, SamplingParams
from vllm_port.spawn import free_port

#: each node's whole run, the model loaded and generated (a few seconds on 2 cores)
_TIMEOUT_S = 240


def _two_nodes(
    model_dir, prompt_ids: list[list[list[int]]], *flags: str, split: str = "--tensor-parallel-size"
) -> list[subprocess.CompletedProcess[str]]:
    """``vllm-port generate`` on two torchrun nodes of one rank each, the model split over them by the ``split``
    flag (``--tensor-parallel-size`` or ``--pipeline-parallel-size``); node ``r`` is given ``prompt_ids[r]``."""
    port = free_port()
    nodes = []
    for rank, ids in enumerate(prompt_ids):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        torchrun += ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        generate = ["-m", "vllm_port.cli", "generate", "--model", str(model_dir), "--json", *flags]
        generate += [split, "2", "--distributed-executor-backend", "external_launcher"]
        generate += [arg for prompt in ids for arg in ("--prompt-token-ids", ",".join(map(str, prompt)))]
        piped = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        nodes.append(subprocess.Popen([*torchrun, *generate], **piped))
    done = []
    for node in nodes:
        try:
            out, err = node.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            raise
        done.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return done


def _token_ids(node: subprocess.CompletedProcess[str]) -> list[list[int]]:
    assert node.returncode == 0, node.stderr[-3000:]
    return [out["token_ids"] for out in json.loads(node.stdout.strip().splitlines()[-1])["outputs"]]


@pytest.mark.slow
def test_two_nodes_launched_by_torchrun_generate_what_one_process_does(engine_models, cpu_runtime):
    model_dir = engine_models["qwen2"]  # two KV heads: one on each node
    batch = prompts([7, 30, 12], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = token_ids(make_llm(model_dir, cpu_runtime).generate(batch, params))
    greedy = _two_nodes(model_dir, [batch, batch], "--temperature", "0", "--max-tokens", "16", "--ignore-eos")
    assert [_token_ids(node) for node in greedy] == [want, want]


@pytest.mark.slow
def test_two_pipeline_stages_on_two_nodes_generate_what_one_process_does(engine_models, cpu_runtime):
    model_dir = engine_models["llama"]  # two layers: one on each node; the last node samples
    batch = prompts([7, 30, 12], seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = token_ids(make_llm(model_dir, cpu_runtime).generate(batch, params))
    flags = ("--temperature", "0", "--max-tokens", "16", "--ignore-eos", "--max-num-batched-tokens", "16")
    stages = _two_nodes(model_dir, [batch, batch], *flags, split="--pipeline-parallel-size")
    assert [_token_ids(node) for node in stages] == [want, want]  # chunked prefill and decode alike


@pytest.mark.slow
def test_a_node_given_another_prompt_stops_both_naming_its_rank(engine_models):
    model_dir = engine_models["qwen2"]
    nodes = _two_nodes(model_dir, [prompts([7], seed=1), prompts([9], seed=2)], "--temperature", "0")
    for node in nodes:
        assert node.returncode != 0
        assert "step 1 of rank(s) [1] is not rank 0's" in node.stderr, node.stderr[-3000:]
        assert "every rank must run the same program with the same prompts" in node.stderr


def test_the_external_launcher_without_torchrun_says_how_to_start_the_ranks(llama_model, cpu_runtime, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"\$WORLD_SIZE is not set; start every rank with a launcher .* torchrun"):
        make_llm(llama_model, cpu_runtime, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: \$WORLD_SIZE is '4'"):
        make_llm(llama_model, cpu_runtime, tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2: \$WORLD_SIZE is '4'"):
        make_llm(llama_model, cpu_runtime, pipeline_parallel_size=2, distributed_executor_backend="external_launcher")


def test_an_executor_backend_this_engine_lacks_is_refused_by_name(llama_model):
    with pytest.raises(ValueError, match=r"distributed_executor_backend is 'ray'; it must be None or 'mp' .*'ray'"):
        LLM(str(llama_model), distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"external_launcher.*drop placement/devices, make_step and importer"):
        LLM(str(llama_model), distributed_executor_backend="external_launcher", importer="hf")


def test_rank_0s_step_result_crosses_as_json_and_comes_back_equal():
    """What rank 0 broadcasts is data (JSON), never pickled code; tokens, token errors and logprobs survive it."""
    from vllm_port.engine.external_launcher import _decode, _encode
    from vllm_port.engine.scheduler import StepResult, TokenError, TopLogprobs

    plain = [5, TokenError("row 1: logits are NaN", cache_suspect=True), 7]
    assert _decode(_encode(plain)) == plain
    top = TopLogprobs(7, -0.25, 1, ((7, -0.25), (3, float("-inf"))))
    rich = StepResult([7, 9], {0: top}, {1: [(4, top)]})
    back = _decode(_encode(rich))
    assert isinstance(back, StepResult) and list(back) == [7, 9]
    assert back.logprobs == {0: top} and back.prompt_logprobs == {1: [(4, top)]}
    assert b"pickle" not in _encode(rich) and _encode(rich).startswith(b"{")
