"""The ``vllm_port`` torch.compile backend: registered by entry point, no graph break, same logits as transformers."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch
import torch._dynamo
from calling_capture import CallingCapture
from paged_harness import Conversation, assert_fp32_close

from vllm_port import flat
from vllm_port.flat.backend import VllmPortBackend
from vllm_port.flat.flat_model import FlatModel
from vllm_port.flat.trace import step_function
from vllm_port.models import load_model

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {f: load_model(d, torch.device("cpu"), torch.float32) for f, d in tiny_dirs.items()}


def test_backend_is_registered_through_the_entry_point():
    (point,) = [ep for ep in entry_points(group="torch_dynamo_backends") if ep.name == "vllm_port"]
    assert point.value == "vllm_port.flat.backend:vllm_port_backend"
    assert "vllm_port" in torch._dynamo.list_backends()
    from torch._dynamo.backends.registry import lookup_backend

    assert isinstance(lookup_backend("vllm_port"), VllmPortBackend)


@pytest.mark.slow
def test_compiled_decode_step_has_no_graph_break_and_runs_with_inductor(models, tiny_dirs, cpu_runtime):
    model = models["llama"]
    ops = flat.traceable_ops(cpu_runtime.bind(torch.float32))
    step = step_function(model, ops, "decode", model.config.num_layers)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = VllmPortBackend(cpu_runtime, compile_trivial=True)  # Inductor compiles even the view-only pieces
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    talk = Conversation(model.config, [6, 11], decode_steps=2)
    eager = FlatModel(model, cpu_runtime, compile=False, block_size=4)
    eager.forward(*talk.prefill()[:2], talk.kv_caches, talk.prefill()[2])
    for t in range(2):
        ids, pos, meta = talk.decode(t)
        with torch.no_grad():
            hidden = compiled(*flat.graph_inputs(ids, pos, talk.kv_caches, meta))
        assert_fp32_close(eager.compute_logits(hidden), talk.expected_decode(tiny_dirs["llama"], t))
    assert not torch._dynamo.utils.counters["graph_break"]
    (report,) = backend.reports  # one compilation: the second step reused it
    layers = model.config.num_layers
    assert report.compiler == "inductor"
    assert report.fusions["fused_add_rms_norm"] == 2 * layers and report.fusions["silu_and_mul"] == layers
    assert report.eager_pieces == layers and report.pieces == layers + 1  # attention runs between compiled pieces


@pytest.mark.slow
def test_backend_by_name_takes_options_and_refuses_unknown_ones(models, cpu_runtime):
    model = models["qwen2"]
    ops = flat.traceable_ops(cpu_runtime.bind(torch.float32))
    step = step_function(model, ops, "decode", model.config.num_layers)
    talk = Conversation(model.config, [6, 5], decode_steps=1)
    FlatModel(model, cpu_runtime, compile=False, block_size=4).forward(
        *talk.prefill()[:2], talk.kv_caches, talk.prefill()[2]
    )
    args = flat.graph_inputs(*talk.decode(0)[:2], talk.kv_caches, talk.decode(0)[2])
    torch._dynamo.reset()
    options = {"runtime": cpu_runtime, "compiler": "none", "split": False}
    with torch.no_grad():
        got = torch.compile(step, backend="vllm_port", options=options, fullgraph=True)(*args)
    want = flat.trace(model, cpu_runtime.bind(torch.float32), phase="decode")(*args)
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"unknown options \['fast'\]"):
        torch.compile(step, backend="vllm_port", options={"fast": True}, fullgraph=True)(*args)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_mode_gives_transformers_logits(models, tiny_dirs, cpu_runtime, family):
    """Eager after the passes, compiled (vllm_port backend, Inductor), and decode graph-captured with padding."""
    model, model_dir = models[family], tiny_dirs[family]
    torch._dynamo.reset()
    runs = {
        "eager": FlatModel(model, cpu_runtime, compile=False, block_size=4),
        "compiled": FlatModel(model, cpu_runtime, compile=True, block_size=4, compile_trivial=True),
    }
    for mode, runner in runs.items():
        # a second batch of another shape: the compiled steps recompile once, with symbolic batch sizes
        for lengths in ([8, 15, 11], [9, 6]):  # 15: past Mistral's window
            talk = Conversation(model.config, lengths, decode_steps=3, seed=1)
            ids, pos, meta = talk.prefill()
            logits = runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta))
            assert_fp32_close(logits, talk.expected_prefill(model_dir))
            for t in range(3):
                ids, pos, meta = talk.decode(t)
                logits = runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta))
                assert_fp32_close(logits, talk.expected_decode(model_dir, t))
        assert runner.mode == mode
    reports = runs["compiled"].backend.reports
    assert len(reports) == 4  # prefill and decode, each static then dynamic
    assert {r.compiler for r in reports} == {"inductor"} and {r.pieces for r in reports} == {
        model.config.num_layers + 1
    }
    # captured: 3 sequences replay the graph captured for 4, one padding row riding along
    talk = Conversation(model.config, [8, 15, 11], decode_steps=3, seed=1)
    runs["eager"].forward(*talk.prefill()[:2], talk.kv_caches, talk.prefill()[2])
    capture = CallingCapture()
    graphs = runs["eager"].capture_decode(talk.kv_caches, [1, 4], talk.tables.shape[1], capture=capture)
    assert len(capture.captured) == 2
    for t in range(3):
        ids, pos, meta = talk.decode(t)
        logits = graphs(ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens)
        assert graphs.bucket(3) == 4 and logits.shape[0] == 3
        assert_fp32_close(logits, talk.expected_decode(model_dir, t))


@pytest.mark.slow
def test_pieces_with_nothing_to_generate_run_as_traced(models, tiny_dirs, cpu_runtime):
    model = models["mistral"]
    runner = FlatModel(model, cpu_runtime, compile=True, block_size=4)  # compile_trivial off: the default
    talk = Conversation(model.config, [7, 12], decode_steps=1, seed=5)
    torch._dynamo.reset()
    ids, pos, meta = talk.prefill()
    assert_fp32_close(
        runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta)),
        talk.expected_prefill(tiny_dirs["mistral"]),
    )
    (report,) = runner.backend.reports
    # after the passes every piece between attention ops is contract ops and views: no compiler run
    assert report.pieces == 0 and report.trivial_pieces == model.config.num_layers + 1
    assert report.fusions["silu_and_mul"] == model.config.num_layers


@pytest.mark.slow
def test_compiled_flat_models_of_different_models_in_one_process_each_compile_their_own(models, tiny_dirs, cpu_runtime):
    """Two compiled FlatModels, of models with other head sizes (attention scales), one after the other, no reset.

    torch.compile keeps its compiled graphs on the code object of the function it compiles. Every FlatModel's step
    is a closure of the same function, so the second model's first call was a recompile of the first's: dynamo's
    automatic dynamic then made the attention scale, a float that differed between the two, a symbolic float,
    which the attention ops' schema (``float scale``) refuses. Each FlatModel now compiles a function of its own.
    """
    torch._dynamo.reset()
    for family in ("llama", "mistral", "qwen2"):  # head sizes 64, 128, 64: scales 1/8, 1/sqrt(128), 1/8
        model = models[family]
        runner = FlatModel(model, cpu_runtime, compile=True, block_size=4)
        talk = Conversation(model.config, [7, 5], decode_steps=1, seed=2)
        ids, pos, meta = talk.prefill()
        logits = runner.compute_logits(runner.forward(ids, pos, talk.kv_caches, meta))
        assert_fp32_close(logits, talk.expected_prefill(tiny_dirs[family]))
        assert len(runner.backend.reports) == 1  # its own first compile, not another model's recompile
