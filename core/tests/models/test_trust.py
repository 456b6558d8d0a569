"""Trust: a model directory is data from elsewhere; loading it never runs code, leaves the directory,
sizes memory by an absurd number, or reaches the network.

- no pickle anywhere: the repository's own code is scanned for every way to unpickle; pickled
  checkpoints (one that would run code when unpickled among them) are refused, naming the file;
- config values are bounded before anything is allocated, and what the weights will take is held
  to the memory there is, both from config.json alone;
- every file read is inside the model directory (shard index entries, symlinks);
- loading and generating work with every socket refused.

The fourth trust item, ``vllm-port certify --verify`` refusing a report whose digest does not match,
is tested in ``conformance/tests/test_certify.py`` (``test_verify_rejects_an_edited_field``).
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import shutil
import socket
import tracemalloc
from pathlib import Path

import pytest
import torch
from tiny_models import TINY_CONFIGS, build_tiny_model

import vllm_port
from vllm_port import LLM, SamplingParams
from vllm_port.data import bundled_model_dir
from vllm_port.errors import ModelLoadError
from vllm_port.models import load_config, load_model, load_weights
from vllm_port.models import loader as loader_module
from vllm_port.models.config import SIZE_LIMITS
from vllm_port.models.loader import check_fits

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[3]


# --- no pickle ------------------------------------------------------------------------------------

#: Calls that unpickle, by the dotted name they are called through.
_UNPICKLERS = {
    f"{module}.{name}"
    for module in ("pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "pandas", "pd")
    for name in ("load", "loads", "Unpickler", "read_pickle")
} | {"shelve.open", "torch.jit.load", "torch.package.PackageImporter"}
#: Where unpickling is allowed, and why: nothing here reads a file or another party's bytes.
_ALLOWED = {
    ("core/src/vllm_port/engine/tensor_parallel.py", "pickle.loads"): "a round trip of an exception this process made",
}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def _unpickling_calls(path: Path) -> list[tuple[int, str]]:
    """Every call in ``path`` that could unpickle: ``(line, what)``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module in ("pickle", "_pickle", "dill", "cloudpickle"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names if "load" in a.name]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name in _UNPICKLERS:
            found.append((node.lineno, name))
        elif name == "torch.load" and not _keyword_is_true(node, "weights_only"):
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif name in ("np.load", "numpy.load") and _keyword_is_true(node, "allow_pickle"):
            found.append((node.lineno, f"{name}(allow_pickle=True)"))
    return found


def _python_files() -> list[Path]:
    skip = {".venv", ".git", "build", "dist", "node_modules", "__pycache__", ".nox", "shared"}
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        files += [Path(root) / n for n in names if n.endswith(".py")]
    return files


@pytest.mark.slow
def test_nothing_in_the_repository_unpickles():
    files = _python_files()
    assert len(files) > 100 and REPO / "core/src/vllm_port/models/loader.py" in files
    found = {
        (path.relative_to(REPO).as_posix(), line, what)
        for path in files
        for line, what in _unpickling_calls(path)
        if (path.relative_to(REPO).as_posix(), what) not in _ALLOWED
    }
    assert not found, f"code that unpickles (runs whatever the bytes say): {sorted(found)}"


def test_the_scan_sees_every_spelling(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text(
        "import pickle, torch, numpy as np\nfrom pickle import loads\n"
        "pickle.load(f)\ntorch.load(p)\ntorch.load(p, weights_only=False)\ntorch.load(p, weights_only=True)\n"
        "np.load(p, allow_pickle=True)\nnp.load(p)\n"
    )
    assert [what for _, what in _unpickling_calls(source)] == [
        "from pickle import loads",
        "pickle.load",
        "torch.load without weights_only=True",
        "torch.load without weights_only=True",
        "np.load(allow_pickle=True)",
    ]


class _RunsCode:
    """Unpickling this calls ``Path.touch`` on the marker: what a malicious checkpoint would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Every unpickler of the standard library and torch fails the test if called."""

    def refuse(*args, **kwargs):
        raise AssertionError("the loader unpickled a file")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)


@pytest.mark.parametrize(
    "names",
    [
        ["pytorch_model.bin"],
        ["consolidated.00.pth"],
        ["model.pt", "optimizer.ckpt"],
        ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"],
    ],
    ids=["transformers", "meta", "pt-and-ckpt", "sharded"],
)
def test_pickled_checkpoints_are_refused_naming_the_files(llama_dir, tmp_path, no_unpickling, names):
    model = tmp_path / "pickled"
    model.mkdir()
    shutil.copy(llama_dir / "config.json", model)
    marker = tmp_path / "code-ran"
    for name in names:
        (model / name).write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ModelLoadError) as info:
        load_model(model, CPU, torch.float32)
    message = str(info.value)
    assert all(name in message for name in names), message
    assert "never loads (unpickling runs arbitrary code)" in message and "save_pretrained" in message
    assert not marker.exists()


def test_a_shard_index_naming_a_pickle_is_refused(llama_dir, tmp_path, no_unpickling):
    model = shutil.copytree(llama_dir, tmp_path / "model")
    (model / "model.safetensors").rename(model / "weights.bin")
    weight_map = {name: "weights.bin" for name in load_weights(llama_dir, load_config(llama_dir), CPU, torch.float32)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=r"field 'weight_map' names 'weights.bin', which is not a .safetensors"):
        load_model(model, CPU, torch.float32)


# --- config values --------------------------------------------------------------------------------

ABSURD = {
    "hidden_size": (10**9, r"an int in \[1, 1,048,576\]"),
    "vocab_size": (10**12, r"an int in \[1, 16,777,216\]"),
    "num_hidden_layers": (10**6, r"an int in \[1, 4,096\]"),
    "intermediate_size": (2**40, r"an int in \[1, 4,194,304\]"),
    "num_attention_heads": (10**5, r"an int in \[1, 4,096\]"),
    "max_position_embeddings": (10**12, r"an int in \[1, 67,108,864\]"),
    "head_dim": (1 << 20, r"an int in \[1, 4,096\]"),
    "bos_token_id": (1 << 40, r"an int in \[0, 16,777,216\]"),
}
WRONG_TYPE = {
    "negative": ("hidden_size", -128, r"is -128 \(int\); expected an int >= 1"),
    "zero": ("num_hidden_layers", 0, r"is 0 \(int\); expected an int >= 1"),
    "fraction": ("hidden_size", 127.5, r"is 127.5 \(float\); expected an int >= 1"),
    "float spelling of an int": ("vocab_size", 512.0, r"is 512.0 \(float\); expected an int"),
    "string": ("intermediate_size", "256", r"is '256' \(str\); expected an int"),
    "infinite": ("rms_norm_eps", float("inf"), r"is inf \(float\); expected a positive finite number"),
    "list": ("num_attention_heads", [4], r"is \[4\] \(list\); expected an int"),
}


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of checkpoint ``src`` whose config.json has ``changes``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("field, value, expected", [(f, v, e) for f, (v, e) in ABSURD.items()], ids=list(ABSURD))
def test_an_absurd_size_is_refused_naming_config_json_and_the_field(llama_dir, tmp_path, field, value, expected):
    model = _with_config(llama_dir, tmp_path / "absurd", **{field: value})
    tracemalloc.start()
    try:
        with pytest.raises(
            ModelLoadError,
            match=rf"config.json: field '{field}' is {value} \(int\); expected {expected}: no model is that large",
        ):
            load_model(model, CPU, torch.float32)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # refused from the file's numbers, before anything was sized by them
    assert field in SIZE_LIMITS


@pytest.mark.parametrize("field, value, expected", WRONG_TYPE.values(), ids=list(WRONG_TYPE))
def test_a_size_of_the_wrong_kind_is_refused_naming_the_field(llama_dir, tmp_path, field, value, expected):
    model = _with_config(llama_dir, tmp_path / "wrong", **{field: value})
    with pytest.raises(ModelLoadError, match=rf"config.json: field '{field}' {expected}"):
        load_config(model)


def test_an_oversized_config_file_is_not_read(llama_dir, tmp_path, monkeypatch):
    model = shutil.copytree(llama_dir, tmp_path / "big")
    monkeypatch.setattr("vllm_port.models.config.MAX_JSON_BYTES", 100)
    with pytest.raises(ModelLoadError, match=r"config.json: config.json is \d[\d,]+ bytes; no model's config.json"):
        load_config(model)


@pytest.mark.parametrize("family", list(TINY_CONFIGS))
def test_the_weights_bytes_come_from_the_config_alone(family, tiny_model_dirs):
    # the reference: transformers' own parameter count of the same checkpoint (a tied head counted once)
    hf = build_tiny_model(family)
    config = load_config(tiny_model_dirs[family])
    assert config.num_parameters == sum(p.numel() for p in hf.parameters())
    rope_table = config.max_position_embeddings * config.head_size * 4
    assert config.weight_bytes(torch.bfloat16) == 2 * config.num_parameters + rope_table
    assert config.largest_tensor_numel == max(p.numel() for p in hf.parameters())


# A Llama-3.1-405B-shaped config.json: every field within bounds, the weights 1.6 TB in float32.
LLAMA_405B = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=16384,
    intermediate_size=53248,
    num_hidden_layers=126,
    num_attention_heads=128,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    torch_dtype="bfloat16",
)


def test_weights_beyond_memory_are_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    model = tmp_path / "405b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_405B))  # no weights: the check comes first
    config = load_config(model)
    assert 405e9 < config.num_parameters < 406e9
    runtime = vllm_port.load(plugins="cpu")
    allocated = []
    monkeypatch.setattr(runtime, "kv_cache", lambda *a, **k: allocated.append(a))
    with pytest.raises(
        ModelLoadError,
        match=r"405b/config.json: the weights take 1,51\d.\d\d GiB in float32 \(405,\d+,\d+,\d+ parameters from "
        r"vocab_size=128,256, hidden_size=16,384, .*num_hidden_layers=126.*\), more than the .* GiB free on "
        r"platform 'cpu''s device; load a smaller dtype, shard it over more devices",
    ):
        LLM(model, device=runtime, dtype="float32")
    assert not allocated


def test_memory_checks_count_the_dtype_the_shards_and_the_host(llama_dir):
    config = load_config(llama_dir)
    need = config.weight_bytes(torch.float32)
    staging = config.largest_tensor_numel * 8  # float32 as read, float32 as loaded
    check_fits(config, torch.float32, device_free=need, host_free=staging)  # exactly enough
    with pytest.raises(ModelLoadError, match=r"the weights take .* in float32 .* more than the"):
        check_fits(config, torch.float32, device_free=need - 1, host_free=staging)
    check_fits(config, torch.bfloat16, device_free=need - 1, host_free=staging)
    check_fits(config, torch.float32, device_free=need // 2 + 1, host_free=staging, num_shards=2)
    with pytest.raises(ModelLoadError, match=r"per device over 2 devices"):
        check_fits(config, torch.float32, device_free=need // 4, host_free=staging, num_shards=2)
    with pytest.raises(ModelLoadError, match=r"loading stages its largest tensor \(65,536 elements.* host memory"):
        check_fits(config, torch.float32, device_free=need, host_free=staging - 1)
    check_fits(config, torch.float32, device_free=None, host_free=staging)  # the host alone


# --- files stay inside the model directory --------------------------------------------------------


def _sharded(tmp_path: Path, name: str = "sharded") -> Path:
    path = tmp_path / name
    build_tiny_model("llama").save_pretrained(path, max_shard_size="300KB")
    return path


def _repoint(model: Path, to: str) -> str:
    """Point the index's entries for the last shard at ``to``; return that shard's name."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: (to if v == last else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return last


@pytest.fixture
def no_weight_moves(monkeypatch):
    def refuse(*args):
        raise AssertionError("a weight moved before the checkpoint's files were checked")

    monkeypatch.setattr(loader_module, "_to_target", refuse)


@pytest.mark.parametrize(
    "entry",
    ["../outside/{shard}", "{outside}/{shard}", "sub/../../outside/{shard}", "..\\outside\\{shard}"],
    ids=["dot-dot", "absolute", "dot-dot-inside", "backslashes"],
)
def test_a_shard_index_naming_a_file_outside_the_directory_is_refused(tmp_path, no_weight_moves, entry):
    model = _sharded(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shard = sorted(p.name for p in model.glob("model-*.safetensors"))[-1]
    shutil.copy(model / shard, outside / shard)  # a real shard waits out there
    _repoint(model, entry.format(outside=outside, shard=shard))
    with pytest.raises(
        ModelLoadError,
        match=r"model.safetensors.index.json field 'weight_map'\) lies outside the model directory",
    ):
        load_weights(model, load_config(model), CPU, torch.float32)


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json", "shard"])
def test_a_symlink_out_of_the_directory_is_refused(llama_dir, tmp_path, no_weight_moves, linked):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if linked == "shard":
        model = _sharded(tmp_path)
        name = sorted(p.name for p in model.glob("model-*.safetensors"))[-1]
    else:
        model = shutil.copytree(llama_dir, tmp_path / "model")
        name = linked
    (model / name).rename(outside / name)
    (model / name).symlink_to(outside / name)
    with pytest.raises(
        ModelLoadError, match=rf"{name}( \(.*\))?: a symlink to .*elsewhere/{name}, outside the model directory"
    ):
        load_model(model, CPU, torch.float32)


def test_a_linked_directory_outside_is_refused_too(llama_dir, tmp_path, no_weight_moves):
    model = _sharded(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = _repoint(model, "shards/last.safetensors")
    (model / shard).rename(outside / "last.safetensors")
    (model / "shards").symlink_to(outside)
    with pytest.raises(ModelLoadError, match=r"shards/last.safetensors \(.*\): a symlink to .*elsewhere"):
        load_model(model, CPU, torch.float32)


def test_links_inside_the_directory_and_a_hub_cache_snapshot_load(llama_dir, tmp_path):
    want = load_weights(llama_dir, load_config(llama_dir), CPU, torch.float32)
    inside = shutil.copytree(llama_dir, tmp_path / "inside")
    (inside / "model.safetensors").rename(inside / "weights.data")
    (inside / "model.safetensors").symlink_to("weights.data")
    # huggingface_hub's cache: models--org--name/snapshots/REV/FILE -> ../../blobs/HASH
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(llama_dir.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    for model in (inside, snapshot):
        got = load_weights(model, load_config(model), CPU, torch.float32)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_tokenizer_linking_out_is_refused(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "model")
    outside = tmp_path / "tokenizer.json"
    outside.write_text("{}")
    (model / "tokenizer.json").symlink_to(outside)
    with pytest.raises(ModelLoadError, match=r"tokenizer.json: a symlink to .*, outside the model directory"):
        LLM(model, device=vllm_port.load(plugins="cpu"), kv_cache_memory=1 << 20)


# --- no network -----------------------------------------------------------------------------------


def test_load_and_generate_with_the_network_refused(monkeypatch):
    """Discovery, the bundled model with its tokenizer, and generation, with every way out refused."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] or args)
        raise OSError("network access at run time")

    for owner, name in (
        (socket.socket, "connect"),
        (socket.socket, "connect_ex"),
        (socket.socket, "sendto"),
        (socket, "create_connection"),
        (socket, "getaddrinfo"),
        (socket, "gethostbyname"),
    ):
        monkeypatch.setattr(owner, name, refuse)
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # nothing may rely on being told
        monkeypatch.delenv(variable, raising=False)
    runtime = vllm_port.load(plugins="cpu")
    llm = LLM(bundled_model_dir(), device=runtime, kv_cache_memory=8 << 20)
    (out,) = llm.generate(["It is a truth universally acknowledged"], SamplingParams(temperature=0, max_tokens=8))
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].text.strip()
    assert attempts == []
