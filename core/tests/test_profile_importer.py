"""``vllm-port profile MODEL_DIR --importer hf``: the imported (``transformers``) model profiled like a core one.

The checkpoints are the importer tests' tiny random ones (``core/tests/models/tiny_models.py``); the
imported model is the one ``LLM(MODEL_DIR, importer="hf")`` runs, checked against transformers as it
is imported.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "models"))

from tiny_models import build_tiny_model, save_tiny_model

import vllm_port
from vllm_port.cli import main
from vllm_port.importer import import_model
from vllm_port.profile import STACK_LAYERS, importer_of, load_profile_model, profile_model

#: As test_profile.py's: two sequences of 32 tokens, three profiled steps, one thread.
QUICK = ["--device", "cpu", "--batch", "2", "--context", "32", "--repeats", "3", "--min-time", "0.05", "--threads", "1"]
API_QUICK: dict[str, Any] = {"batch": 2, "context": 32, "repeats": 2, "min_run_time": 0.02}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("profile-import") / "llama")


@pytest.fixture(scope="module")
def profiles(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The tiny Llama profiled from the command line twice: imported, and with the core model definition."""
    out = tmp_path_factory.mktemp("profiles")
    imported, core = out / "imported.json", out / "core.json"
    assert main(["profile", str(llama_dir), "--importer", "hf", *QUICK, "--json", str(imported)]) == 0
    assert main(["profile", str(llama_dir), *QUICK, "--json", str(core)]) == 0
    return {"imported": json.loads(imported.read_text()), "core": json.loads(core.read_text()), "dir": out}


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _node_list(report: dict, phase: str) -> list[tuple]:
    return [
        (n["name"], n["op"], n["kind"], n["plugin"], n["provider"], n["layer"], n["stack_layer"])
        for n in report["phases"][phase]["nodes"]
    ]


@pytest.mark.slow
def test_the_imported_model_is_profiled_node_by_node_with_contract_ops_and_native_nodes(profiles):
    report = profiles["imported"]
    assert report["importer"] == "hf" and report["model"]["architecture"] == "LlamaForCausalLM"
    for phase, attention in [("decode", "paged_attention"), ("prefill", "prefill_attention")]:
        nodes = report["phases"][phase]["nodes"]
        ops = {n["op"] for n in nodes if n["kind"] == "contract"}
        assert {"embedding", "linear", "rotary_embedding", "reshape_and_cache", attention, "silu_and_mul"} <= ops, phase
        assert ops & {"rms_norm", "fused_add_rms_norm"}, phase
        assert all(
            n["provider"].startswith("cpu_") and n["stack_layer"] == "ops" for n in nodes if n["kind"] == "contract"
        )
        # the residual adds go into the next norm, as in the core graph (the importer carries them as rows)
        assert not [n for n in nodes if n["op"] == "aten.add.Tensor"], phase
        assert len([n for n in nodes if n["op"] == "fused_add_rms_norm"]) == 4, phase  # 2 per layer, as core
        # what the importer leaves as torch ops (layout nodes here): native nodes of the graph layer
        native = [n for n in nodes if n["kind"] == "native"]
        assert native and all(n["stack_layer"] == "graph" and n["provider"] == "torch" for n in native), phase
        # layers from the weights and caches each node reads, as in the core graph: 2 decoder layers
        assert {n["layer"] for n in nodes} == {None, 0, 1}
        assert [n["name"] for n in nodes[-3:]] == ["logits_rows", "lm_head.slice_1", "lm_head"]  # the head piece
        assert all(n["time_us"] > 0 for n in nodes if n["kind"] == "contract")
    assert report["groups"]["memory"]["weights_bytes"] > 0


def _keys(value: Any) -> Any:
    """The JSON's shape: the keys of every object, the shape of a list's first item."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items() if k not in ("fusions", "counts", "compile")}
    if isinstance(value, list):
        return [_keys(value[0])] if value else []
    return None


def test_the_json_has_the_shape_of_the_core_profile(profiles):
    imported, core = profiles["imported"], profiles["core"]
    assert core["importer"] is None and _keys(imported) == _keys(core)
    assert set(imported["phases"]["decode"]["stack_layers"]) == set(STACK_LAYERS)


@pytest.mark.slow
def test_profiling_the_imported_model_twice_gives_the_same_node_list(llama_dir, profiles, one_thread):
    runtime = vllm_port.load(device="cpu")
    model = load_profile_model(llama_dir, runtime, importer="hf")
    assert importer_of(model) == "hf"
    again = profile_model(model, runtime, phases=("decode",), **API_QUICK)
    assert again["importer"] == "hf"
    assert _node_list(again, "decode") == _node_list(profiles["imported"], "decode")


def test_a_core_baseline_is_refused_for_an_imported_profile_and_the_other_way_round(llama_dir, profiles, capsys):
    core, imported = profiles["dir"] / "core.json", profiles["dir"] / "imported.json"
    capsys.readouterr()
    assert main(["profile", str(llama_dir), "--importer", "hf", *QUICK, "--baseline", str(core)]) == 2
    err = capsys.readouterr().err
    assert "not comparable" in err
    assert "importer none (the core model definition) in the baseline, 'hf' (an imported model) now (--importer)" in err
    assert main(["profile", str(llama_dir), *QUICK, "--baseline", str(imported)]) == 2
    assert (
        "importer 'hf' (an imported model) in the baseline, none (the core model definition) now"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_an_imported_profile_compared_with_its_own_baseline_runs(llama_dir, profiles, capsys):
    imported = profiles["dir"] / "imported.json"
    status = main(
        ["profile", str(llama_dir), "--importer", "hf", *QUICK, "--phase", "decode", "--baseline", str(imported)]
    )
    out = capsys.readouterr().out
    assert status in (0, 1) and "verdict:" in out  # times on a shared host may move; the profiles compare
    assert "imported by 'hf'" in out


@pytest.mark.slow
def test_native_nodes_in_an_imported_lm_head_are_nodes_of_their_own(one_thread):
    runtime = vllm_port.load(device="cpu")
    model = import_model(build_tiny_model("gemma2"), runtime)  # final logit soft cap: div, tanh, mul after the head
    report = profile_model(model, runtime, phases=("decode",), **API_QUICK)
    tail = [(n["name"], n["op"], n["kind"]) for n in report["nodes"]][-5:]
    assert tail == [
        ("lm_head.slice_1", "aten.slice.Tensor", "native"),
        ("lm_head", "linear", "contract"),
        ("lm_head.div", "aten.div.Tensor", "native"),
        ("lm_head.tanh", "aten.tanh.default", "native"),
        ("lm_head.mul", "aten.mul.Tensor", "native"),
    ]
    assert all(n["time_us"] > 0 and n["layer"] is None for n in report["nodes"][-5:])


def test_an_unknown_importer_is_refused(llama_dir, capsys):
    with pytest.raises(SystemExit):
        main(["profile", str(llama_dir), "--importer", "onnx", *QUICK])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    from vllm_port.profile import ProfileError

    with pytest.raises(ProfileError, match="importer 'onnx' is unknown"):
        load_profile_model(llama_dir, vllm_port.load(device="cpu"), importer="onnx")
