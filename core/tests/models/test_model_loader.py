"""``load_weights``: single and sharded safetensors, streamed shard by shard, and every bad directory refused.

Each bad directory is built in the test from a copy of the tiny Llama checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_tiny_model

from vllm_port.errors import ModelLoadError
from vllm_port.models import expected_weights, load_config, load_model, load_weights
from vllm_port.models import loader as loader_module

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """The tiny Llama again, saved in shards of at most 300 kB with an index."""
    path = tmp_path_factory.mktemp("llama-sharded")
    build_tiny_model("llama").save_pretrained(path, max_shard_size="300KB")
    assert len(list(path.glob("model-*.safetensors"))) > 2 and (path / "model.safetensors.index.json").exists()
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_equals_single_file(llama_dir, sharded_dir):
    config = load_config(llama_dir)
    single = load_weights(llama_dir, config, CPU, torch.float32)
    sharded = load_weights(sharded_dir, config, CPU, torch.float32)
    assert list(single) == list(sharded) == list(expected_weights(config))
    for name, tensor in single.items():
        assert torch.equal(tensor, sharded[name]), name


def test_streams_one_shard_at_a_time_in_target_dtype(sharded_dir, monkeypatch):
    opened: list[str] = []
    open_now: list[str] = []
    moved: list[tuple[str, tuple[str, ...]]] = []
    real_open, real_move = loader_module.safe_open, loader_module._to_target

    class TrackedOpen:
        def __init__(self, path, **kwargs):
            self.path, self.file = path, real_open(path, **kwargs)

        def __enter__(self):
            opened.append(Path(self.path).name)
            open_now.append(self.path)
            return self.file.__enter__()

        def __exit__(self, *exc):
            open_now.remove(self.path)
            return self.file.__exit__(*exc)

    def tracked_move(tensor, device, dtype):
        moved.append((tensor.dtype, tuple(open_now)))
        return real_move(tensor, device, dtype)

    monkeypatch.setattr(loader_module, "safe_open", TrackedOpen)
    monkeypatch.setattr(loader_module, "_to_target", tracked_move)
    config = load_config(sharded_dir)
    weights = load_weights(sharded_dir, config, CPU, torch.bfloat16)
    shards = sorted(p.name for p in sharded_dir.glob("model-*.safetensors"))
    assert opened == shards + shards  # headers first, then each shard once for its data
    assert len(moved) == len(weights) and all(len(now) == 1 for _, now in moved)  # one shard open per move
    assert {dtype for dtype, _ in moved} == {torch.float32}  # the checkpoint's dtype, converted on the way
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_tied_lm_head_and_unused_tensors_are_skipped(qwen2_dir, llama_dir, tmp_path):
    assert "lm_head.weight" not in load_weights(qwen2_dir, load_config(qwen2_dir), CPU, torch.float32)
    extra = _copy(llama_dir, tmp_path / "extra")
    tensors = load_file(extra / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(32)  # what old Llama 2 checkpoints carry
    save_file(tensors, extra / "model.safetensors", metadata={"format": "pt"})
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in load_weights(
        extra, load_config(extra), CPU, torch.float32
    )


def _rewrite(path: Path, change) -> None:
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:12] = b"{xx\x00"
    path.write_bytes(bytes(data))


Q1 = "model.layers.1.self_attn.q_proj.weight"
BAD_SINGLE = {
    "truncated file": (lambda d: _truncate(d / "model.safetensors"), r"model.safetensors: .*corrupt or truncated"),
    "corrupt header": (
        lambda d: _corrupt_header(d / "model.safetensors"),
        r"model.safetensors: .*corrupt or truncated",
    ),
    "missing tensor": (
        lambda d: _rewrite(d / "model.safetensors", lambda t: t.pop(Q1)),
        rf"tensor\(s\) '{Q1}' missing from model.safetensors",
    ),
    "shape disagrees with config": (
        lambda d: _rewrite(d / "model.safetensors", lambda t: t.update({Q1: t[Q1][:128]})),
        rf"model.safetensors: tensor '{Q1}' has shape \[128, 128\], but config.json implies \[256, 128\] "
        r"\(\[num_attention_heads=4 \* head_dim=64, hidden_size=128\]\)",
    ),
    "quantized tensor": (
        lambda d: _rewrite(d / "model.safetensors", lambda t: t.update({Q1: t[Q1].to(torch.int8)})),
        rf"tensor '{Q1}' has dtype I8; expected a float .* quantized",
    ),
    "only pickled weights": (
        lambda d: [(d / "model.safetensors").unlink(), (d / "pytorch_model.bin").write_bytes(b"not a pickle")],
        r"only pickled checkpoints \(pytorch_model.bin\), which vllm-port never loads .*save_pretrained",
    ),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), r"no weights: expected model.safetensors"),
}


@pytest.mark.parametrize("damage, match", BAD_SINGLE.values(), ids=BAD_SINGLE.keys())
def test_bad_single_file_checkpoint(llama_dir, tmp_path, damage, match):
    bad = _copy(llama_dir, tmp_path / "bad")
    damage(bad)
    with pytest.raises(ModelLoadError, match=match):
        load_model(bad, CPU, torch.float32)


def _edit_index(d: Path, change) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    change(index["weight_map"])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _last_shard(d: Path) -> Path:
    return sorted(d.glob("model-*.safetensors"))[-1]


BAD_SHARDED = {
    "shard file missing": (
        lambda d: _last_shard(d).unlink(),
        r"model-\d+-of-\d+.safetensors: the weight file is missing",
    ),
    "tensor not in index": (
        lambda d: _edit_index(d, lambda m: m.pop("model.norm.weight")),
        r"'model.norm.weight' missing from the index model.safetensors.index.json",
    ),
    "index points at the wrong shard": (
        lambda d: _edit_index(d, lambda m: m.update({"model.norm.weight": sorted(set(m.values()))[0]})),
        r"'model.norm.weight' missing from model-00001-of-\d+.safetensors, where model.safetensors.index.json",
    ),
    "index not JSON": (
        lambda d: (d / "model.safetensors.index.json").write_text("{"),
        r"index.json: cannot read the shard index",
    ),
    "truncated last shard": (lambda d: _truncate(_last_shard(d)), r"model-\d+-of-\d+.safetensors: .*truncated"),
    "wrong shape in last shard": (
        lambda d: _rewrite(_last_shard(d), lambda t: t.update({k: t[k][:-1] for k in t})),
        r"model-\d+-of-\d+.safetensors: tensor .* has shape",
    ),
}


@pytest.mark.parametrize("damage, match", BAD_SHARDED.values(), ids=BAD_SHARDED.keys())
def test_bad_sharded_checkpoint_refused_before_any_weight_moves(sharded_dir, tmp_path, monkeypatch, damage, match):
    bad = _copy(sharded_dir, tmp_path / "bad")
    damage(bad)

    def no_move(*args):
        raise AssertionError("a weight moved to the device before the checkpoint was checked")

    monkeypatch.setattr(loader_module, "_to_target", no_move)
    with pytest.raises(ModelLoadError, match=match):
        load_weights(bad, load_config(bad), CPU, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_dtype_the_ops_cannot_run(llama_dir, dtype):
    with pytest.raises(ModelLoadError, match=rf"dtype {dtype} cannot run: .*bfloat16, float16, float32"):
        load_model(llama_dir, CPU, dtype)
