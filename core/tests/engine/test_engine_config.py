"""``EngineConfig``: ``LLM``'s arguments as one value that checks itself, and ``LLM.from_config``.

- every field is refused by its own name, with the message ``LLM(...)`` gives, when the config is made;
- the fields are ``LLM``'s arguments, same names, order and defaults, so neither drifts from the other;
- ``LLM.from_config(config)`` builds the engine ``LLM(**fields)`` builds: same sizes, same tokens;
- the module imports no torch (a server or CLI checks its settings without it).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
from llm_helpers import make_llm, prompts, token_ids

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.engine import EngineConfig
from vllm_port.engine import config as config_module


@pytest.mark.parametrize(
    ("argument", "value", "expected"),
    [
        ("max_num_seqs", 0, "an int >= 1 (the most requests running at once)"),
        ("max_num_batched_tokens", 2.0, "an int >= 1 (tokens one step may run)"),
        ("max_model_len", 1, "None or an int >= 2 (prompt and output)"),
        ("tensor_parallel_size", True, "an int >= 1 (devices to shard the model over)"),
        ("kv_cache_memory", 1.5, "None (the platform's default), a fraction in (0, 1]"),
        ("swap_space", -1, "None or an int of bytes >= 0 (0: no swap)"),
        ("seed", "7", "None or an int"),
        ("plugins", ["cpu"], "None or an allow/deny list such as 'cpu' or '-rocm'"),
        ("enable_prefix_caching", "yes", "True or False"),
        ("enforce_eager", 1, "True or False"),
    ],
)
def test_a_field_is_refused_by_its_own_name_with_llms_message(argument, value, expected):
    with pytest.raises(ValueError) as refused:
        EngineConfig(**{argument: value})
    assert str(refused.value).startswith(f"LLM({argument}={value!r}): {argument} is {value!r}; it must be {expected}")
    with pytest.raises(ValueError) as through_llm:
        LLM(device="no-such-platform", **{argument: value})  # refused before any platform loads
    assert str(through_llm.value) == str(refused.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size": 0}, r"block_size is 0; it must be a positive int \(tokens per KV-cache block\)"),
        ({"block_size": 16.0}, "block_size is 16.0; it must be a positive int"),
        (
            {"placement": {"lm_head": "cpu"}, "tensor_parallel_size": 2},
            "use tensor_parallel_size=1 and pipeline_parallel_size=1 with placement",
        ),
        ({"devices": ["cpu"], "importer": "hf"}, "placement of imported models is not supported yet"),
        ({"make_step": lambda runner: None, "tensor_parallel_size": 2}, "make_step runs in this process"),
    ],
)
def test_fields_no_mode_combines_are_refused_when_the_config_is_made(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_the_config_is_frozen_and_a_changed_copy_is_checked_again():
    config = EngineConfig(max_num_seqs=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 0  # type: ignore[misc]
    assert dataclasses.replace(config, max_num_seqs=4).max_num_seqs == 4
    with pytest.raises(ValueError, match="max_num_seqs is 0"):
        dataclasses.replace(config, max_num_seqs=0)


def test_the_modes_are_told_apart_by_the_fields():
    assert not EngineConfig().imports and not EngineConfig().places
    assert EngineConfig(importer="hf").imports
    assert EngineConfig(devices=["cpu"]).places and EngineConfig(placement="policy.toml").places


def test_the_fields_are_llms_arguments_same_order_and_defaults():
    parameters = list(inspect.signature(LLM.__init__).parameters.values())[1:]  # without self
    fields = dataclasses.fields(EngineConfig)
    assert [p.name for p in parameters] == [f.name for f in fields]
    assert [p.default for p in parameters] == [f.default for f in fields]


def test_llm_init_reads_in_one_screen():
    assert len(inspect.getsource(LLM.__init__).splitlines()) < 50


def test_engine_config_is_exported_where_llm_is():
    assert vllm_port.EngineConfig is EngineConfig is config_module.EngineConfig
    assert "EngineConfig" in vllm_port.__all__ and "EngineConfig" in vllm_port.engine.__all__


def test_the_config_module_imports_no_torch_at_run_time():
    tree = ast.parse(inspect.getsource(config_module))
    typing_only = {id(n) for node in tree.body if isinstance(node, ast.If) for n in ast.walk(node)}  # TYPE_CHECKING
    imported = {
        "." * node.level + (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only
        for alias in node.names
    }
    assert not {n for n in imported if n.split(".")[0] == "torch" or n.startswith(".")}, imported


def test_from_config_builds_the_engine_llm_builds(llama_model, cpu_runtime):
    arguments = {"kv_cache_memory": 2 << 20, "block_size": 8, "max_num_seqs": 4, "seed": 3}
    config = EngineConfig(model=str(llama_model), device=cpu_runtime, **arguments)
    direct = make_llm(llama_model, cpu_runtime, **arguments)
    built = LLM.from_config(config)
    assert built.engine_config == config == direct.engine_config  # as given: async_scheduling None stays None
    assert built.runs_ahead is direct.runs_ahead is False  # the default as the cpu platform runs it
    assert (built.max_model_len, built.runner.pool.num_blocks, built.runner.block_size, built.dtype) == (
        direct.max_model_len,
        direct.runner.pool.num_blocks,
        direct.runner.block_size,
        direct.dtype,
    )
    batch, params = prompts([5, 9, 3], seed=4), SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True)
    assert token_ids(built.generate(batch, params)) == token_ids(direct.generate(batch, params))


def test_captured_rows_cover_the_decode_batch_and_small_prefill_steps():
    """Decode steps of every batch up to max_num_seqs replay graphs, and so do other steps of up to 512 tokens."""
    assert EngineConfig(max_num_seqs=4, max_num_batched_tokens=2048).captured_rows == config_module.MAX_CAPTURED_TOKENS
    assert EngineConfig(max_num_seqs=4, max_num_batched_tokens=100).captured_rows == 100
    assert EngineConfig(max_num_seqs=600, max_num_batched_tokens=2048).captured_rows == 600
    # decode steps of 600 sequences replay; prefill and mixed steps still of 512 tokens at most
    assert EngineConfig(max_num_seqs=600, max_num_batched_tokens=2048).replayed_prefill_tokens == 512
