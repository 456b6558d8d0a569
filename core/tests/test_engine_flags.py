"""vLLM's engine flags on ``vllm-port serve`` and ``generate``: each one reaches ``LLM`` as its field, absent ones not at all."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_port.cli import build_parser
from vllm_port.cli_flags import ENGINE_FLAGS, engine_kwargs
from vllm_port.engine import EngineConfig


def test_every_flag_names_an_engine_config_field():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(ENGINE_FLAGS) <= fields, set(ENGINE_FLAGS) - fields


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_flags_become_the_fields_vllm_serve_would_set(command):
    argv = [command, "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--block-size", "32",
            "--swap-space", "0.5", "--kv-cache-memory", "0.25", "--async-scheduling", "--enforce-eager",
            "--no-enable-prefix-caching", "-tp", "1", "--kv-cache-dtype", "fp8", "--max-model-len", "96"]  # fmt: skip
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    assert kwargs == dict(
        max_num_batched_tokens=512, max_num_seqs=8, block_size=32, swap_space=1 << 29, kv_cache_memory=0.25,
        async_scheduling=True, enforce_eager=True, enable_prefix_caching=False, tensor_parallel_size=1,
        kv_cache_dtype="fp8", max_model_len=96,
    )  # fmt: skip
    EngineConfig(**kwargs)  # a config that checks itself accepts them


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_absent_flags_leave_the_engine_its_defaults(command):
    assert engine_kwargs(build_parser().parse_args([command])) == {}
    assert engine_kwargs(build_parser().parse_args([command, "--kv-cache-memory", "4e6"])) == {
        "kv_cache_memory": 4_000_000
    }


def test_serve_refuses_launched_ranks_by_leaving_the_flag_out(capsys):
    """The server is one process: ranks that torchrun launched would each need the same requests."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--distributed-executor-backend", "external_launcher"])
    assert "--distributed-executor-backend" in capsys.readouterr().err
    assert engine_kwargs(build_parser().parse_args(["generate", "--distributed-executor-backend", "mp"])) == {
        "distributed_executor_backend": "mp"
    }
