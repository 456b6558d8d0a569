"""Plugins sink into compilation: graph passes and their own compile backend (contract API 1.1), and a
platform with no compiler runs the same model eagerly at full correctness."""

from __future__ import annotations

import pytest
import torch
from paged_harness import Conversation, assert_fp32_close
from plugin_factory import healthy

import vllm_port
from vllm_port import flat
from vllm_port.errors import PluginError
from vllm_port.flat.flat_model import FlatModel
from vllm_port.flat.passes import apply_passes
from vllm_port.models import load_model

PASSES_PLUGIN = """
from vllm_port import hookimpl
from vllm_port.flat import contract_op
from vllm_port.flat.passes import GraphPass

CALLS = []

def mark_attention(module, context):
    found = [n for n in module.graph.nodes if contract_op(n) == "paged_attention"]
    for node in found:
        node.meta["seen_by"] = "sinker"
    return len(found)

def record_compile(graph_module, example_inputs):
    CALLS.append(len(example_inputs))
    return graph_module.forward

@hookimpl
def vllm_port_api_range():
    return ">=1.1,<2"

@hookimpl
def vllm_port_graph_passes(platform):
    return [GraphPass("mark_attention", mark_attention)] if platform.name == "cpu" else None

@hookimpl
def vllm_port_compile_backend(platform):
    return record_compile if platform.name == "cpu" else None
"""

BROKEN_PASS = """
from vllm_port import hookimpl
from vllm_port.flat.passes import GraphPass

def explode(module, context):
    raise RuntimeError("pattern table missing")

@hookimpl
def vllm_port_api_range():
    return ">=1.1,<2"

@hookimpl
def vllm_port_graph_passes(platform):
    return [GraphPass("explode", explode)]
"""


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return load_model(tiny_dirs["llama"], torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_plugin_pass_runs_after_core_fusions_and_is_reported(install_plugin, llama):
    module = install_plugin("sinker", PASSES_PLUGIN)
    runtime = vllm_port.load(plugins="cpu,sinker")
    assert not [r.error for r in runtime.discovery.plugins if r.error]
    graph = apply_passes(flat.trace(llama, runtime.bind(torch.float32)), runtime)
    assert list(graph.fusions)[-1] == "mark_attention"  # plugins' passes run after core's
    assert graph.fusions["mark_attention"] == llama.config.num_layers and graph.fusions["silu_and_mul"] == 2
    marked = [n for n in graph.module.graph.nodes if n.meta.get("seen_by") == "sinker"]
    assert len(marked) == llama.config.num_layers
    # the plugin's compiler compiles the pieces between attention ops
    runner = FlatModel(llama, runtime, compile=True, block_size=4, compile_trivial=True)
    talk = Conversation(llama.config, [5, 7], decode_steps=1)
    torch._dynamo.reset()
    runner.forward(*talk.prefill()[:2], talk.kv_caches, talk.prefill()[2])
    calls = __import__(module).CALLS
    assert len(calls) == llama.config.num_layers + 1
    (report,) = runner.backend.reports
    assert report.compiler == "record_compile" and report.fusions["mark_attention"] == 0  # prefill: no paged_attention


def test_a_failing_plugin_pass_names_the_plugin_and_the_pass(install_plugin, llama):
    install_plugin("broken-pass", BROKEN_PASS)
    runtime = vllm_port.load(plugins="cpu,broken-pass")
    with pytest.raises(PluginError, match=r"plugin 'broken-pass': graph pass 'explode' raised RuntimeError"):
        apply_passes(flat.trace(llama, runtime.bind(torch.float32)), runtime)


@pytest.mark.slow
def test_platform_without_a_compiler_runs_the_model_eagerly_and_exactly(install_plugin, llama, tiny_dirs):
    # a new chip on day one: no Inductor code generation, no graph capture, a plugin of API 1.0 (no new hooks)
    install_plugin(
        "dayone",
        healthy("dayone", 50).replace(
            'dist_backend="gloo")', 'dist_backend="gloo", compile_backend="none", graph_capture=False)'
        ),
    )
    runtime = vllm_port.load(plugins="dayone", device="dayone")
    assert runtime.platform.compile_backend == "none" and runtime.graph_capture() is None
    runner = FlatModel(llama, runtime, block_size=4)
    assert runner.mode == "eager" and set(runner.graph("decode").providers().values()) == {"reference"}
    talk = Conversation(llama.config, [9, 6], decode_steps=2, seed=4)
    ids, pos, meta = talk.prefill()
    assert_fp32_close(
        runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta)), talk.expected_prefill(tiny_dirs["llama"])
    )
    for t in range(2):
        ids, pos, meta = talk.decode(t)
        logits = runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta))
        assert_fp32_close(logits, talk.expected_decode(tiny_dirs["llama"], t))
    with pytest.raises(ValueError, match="has no graph capture"):
        runner.capture_decode(talk.kv_caches, [1, 2], 4)
