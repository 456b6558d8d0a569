"""Hostile model files (issue 25): what is not a regular file, nests too deep or holds an absurd
integer is refused at once with a ``ModelLoadError`` naming the file and the field, never a hang,
a ``RecursionError`` or a bare ``ValueError``.

Every case is a real file in a copy of the bundled model: a FIFO made with ``os.mkfifo``, a
directory where a file should be, a JSON config nested 100,000 deep, a 5,000-digit integer.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from vllm_port import LLM
from vllm_port.data import bundled_model_dir
from vllm_port.engine.tokenizer import Tokenizer
from vllm_port.errors import ModelLoadError
from vllm_port.models import load_config, load_model
from vllm_port.models.config import MAX_JSON_DEPTH, MAX_JSON_INT_DIGITS

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are a POSIX thing")

CPU = torch.device("cpu")


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A writable copy of the bundled model."""
    return Path(shutil.copytree(bundled_model_dir(), tmp_path / "model"))


def _config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def _refused_within(seconds: float, load: Callable[[], object], fifo: Path | None = None) -> ModelLoadError:
    """Run ``load`` on a thread; it must raise ModelLoadError within ``seconds`` (a reader stuck on
    ``fifo`` is released by opening it for writing, so a regression fails instead of hanging)."""
    outcome: list[BaseException | object] = []

    def run() -> None:
        try:
            outcome.append(load())
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive() and fifo is not None:
        with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass  # the blocked reader now sees end-of-file
        thread.join(5)
        pytest.fail(f"loading blocked on the FIFO {fifo.name} for {seconds} s instead of refusing it")
    assert outcome and isinstance(outcome[0], ModelLoadError), f"expected ModelLoadError, got {outcome}"
    return outcome[0]


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def test_a_fifo_named_config_json_is_refused_at_once(model):
    fifo = _fifo(model / "config.json")
    error = _refused_within(5, lambda: load_config(model), fifo)
    assert "config.json: config.json is a FIFO (named pipe), not a regular file" in str(error)


def test_a_fifo_named_generation_config_json_is_refused_at_once(model):
    fifo = _fifo(model / "generation_config.json")
    error = _refused_within(5, lambda: load_config(model), fifo)
    assert "generation_config.json: generation_config.json is a FIFO" in str(error)


def test_a_fifo_named_tokenizer_json_is_refused_at_once(model):
    fifo = _fifo(model / "tokenizer.json")
    error = _refused_within(5, lambda: Tokenizer.from_model_dir(model), fifo)
    assert "tokenizer.json: tokenizer.json is a FIFO (named pipe), not a regular file" in str(error)


def test_a_fifo_named_model_safetensors_is_refused_at_once(model):
    fifo = _fifo(model / "model.safetensors")
    error = _refused_within(5, lambda: load_model(model, CPU, torch.float32), fifo)
    assert "model.safetensors: a safetensors weight file is a FIFO (named pipe), not a regular file" in str(error)


def test_a_fifo_shard_index_is_refused_at_once(model):
    fifo = _fifo(model / "model.safetensors.index.json")
    error = _refused_within(5, lambda: load_model(model, CPU, torch.float32), fifo)
    assert "model.safetensors.index.json: the shard index is a FIFO" in str(error)


def test_a_directory_named_config_json_is_refused(model):
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    with pytest.raises(ModelLoadError, match=r"config.json: config.json is a directory, not a regular file"):
        load_config(model)


def test_the_engine_refuses_a_fifo_config_without_hanging(model):
    fifo = _fifo(model / "config.json")
    error = _refused_within(30, lambda: LLM(model, device="cpu"), fifo)
    assert "config.json is a FIFO" in str(error)


def test_a_config_nested_100k_deep_is_refused_naming_the_field(model):
    config = _config(model)
    text = json.dumps(config)[:-1] + ', "rope_scaling": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (model / "config.json").write_text(text)
    with pytest.raises(
        ModelLoadError,
        match=rf"config.json: field 'rope_scaling' of config.json nests arrays and objects more than {MAX_JSON_DEPTH} deep",
    ):
        load_config(model)


def test_a_config_nested_deep_at_its_top_level_is_refused(model):
    (model / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelLoadError, match=r"config.json: its top level of config.json nests"):
        load_config(model)


def test_brackets_inside_strings_do_not_count_as_nesting(model):
    config = _config(model)
    config["note"] = "[{" * 1000
    (model / "config.json").write_text(json.dumps(config))
    assert load_config(model).hidden_size == config["hidden_size"]


def test_a_5000_digit_integer_is_refused_naming_the_field(model):
    config = _config(model)
    text = json.dumps(config).replace('"vocab_size": 4096', '"vocab_size": ' + "9" * 5000)
    (model / "config.json").write_text(text)
    with pytest.raises(
        ModelLoadError,
        match=rf"config.json: field 'vocab_size' of config.json is an integer of 5,000 digits; no size or token id "
        rf"has more than {MAX_JSON_INT_DIGITS}",
    ):
        load_config(model)


def test_a_huge_integer_in_an_array_is_refused(model):
    (model / "generation_config.json").write_text('{"eos_token_id": [1, -' + "7" * 30 + "]}")
    with pytest.raises(ModelLoadError, match=r"generation_config.json: a value in an array of generation_config.json"):
        load_config(model)


def test_a_huge_integer_in_the_shard_index_is_refused(model):
    (model / "model.safetensors.index.json").write_text('{"metadata": {"total_size": ' + "1" * 5000 + "}}")
    with pytest.raises(
        ModelLoadError, match=r"index.json: field 'total_size' of the shard index is an integer of 5,000"
    ):
        load_model(model, CPU, torch.float32)


def test_an_oversized_tokenizer_is_not_read(model, monkeypatch):
    monkeypatch.setattr("vllm_port.engine.tokenizer.MAX_TOKENIZER_BYTES", 1000)
    with pytest.raises(
        ModelLoadError, match=r"tokenizer.json: tokenizer.json is [\d,]+ bytes; no model.s tokenizer.json is over 1,000"
    ):
        Tokenizer.from_model_dir(model)


def test_a_regular_copy_still_loads(model):
    assert Tokenizer.from_model_dir(model).vocab_size > 0
    assert load_config(model).vocab_size == _config(model)["vocab_size"]
