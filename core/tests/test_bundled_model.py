"""The bundled default model (when present) and the script that trains it, ``dev/train_bundled_model.py``.

The bundled directory must load with the flat model's loader and with ``transformers``, stay a few
megabytes, and carry a tokenizer that gives back the text it was given. The script is run end to end
on a small text of its own (a few steps of a one-layer model into a temporary directory) and its
``--prepare`` step on a synthetic Debian package built here in the layout of ``r-cran-janeaustenr``.
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import math
import re
import struct
import sys
import tarfile
import zlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from vllm_port.data import BUNDLED_MODEL_DIR, bundled_model_dir
from vllm_port.errors import ModelLoadError
from vllm_port.models import load_config, load_model

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "train_bundled_model.py"
#: Text with what a tokenizer tends to get wrong: punctuation runs, a blank line, digits, non-ASCII.
ROUND_TRIP = (
    'It is a truth -- "universally" acknowledged; that £20,000 a year...\n\nWell! Naïve café? Yes:  two  spaces.'
)
#: The bundled model must stay "a few million parameters, a few MB".
MAX_PARAMS, MAX_BYTES = 10_000_000, 24 * 2**20

needs_bundled = pytest.mark.skipif(
    not (BUNDLED_MODEL_DIR / "config.json").is_file(),
    reason="no bundled model in this tree (dev/train_bundled_model.py)",
)


@pytest.fixture(scope="module")
def script() -> ModuleType:
    """``dev/train_bundled_model.py`` imported as a module (registered first: its dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location("train_bundled_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


# ---------------------------------------------------------------------------------------------------
# The bundled directory
# ---------------------------------------------------------------------------------------------------


@needs_bundled
def test_bundled_model_loads_with_flat_loader_at_documented_size() -> None:
    directory = bundled_model_dir()
    config = load_config(directory)
    assert config.architecture == "LlamaForCausalLM" and config.tie_word_embeddings
    assert config.bos_token_id == 0 and config.eos_token_ids == (1,)
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        n_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert 1_000_000 <= n_params <= MAX_PARAMS
    readme = (directory / "README.md").read_text()
    assert f"{n_params:,} parameters" in readme, "README.md must state the parameter count of the weights it ships"
    assert "public domain" in readme and "r-cran-janeaustenr" in readme
    size = sum(f.stat().st_size for f in directory.iterdir())
    assert size <= MAX_BYTES, f"bundled model is {size / 2**20:.1f} MiB; keep it a few MB"
    model = load_model(directory, "cpu", torch.float32)
    assert model.config == config


@needs_bundled
def test_bundled_tokenizer_round_trips_text() -> None:
    directory = bundled_model_dir()
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == load_config(directory).vocab_size
    ids = tokenizer.encode(ROUND_TRIP).ids
    assert ids[0] == 0 and 0 not in ids[1:] and 1 not in ids, "<s> (0) starts every encoding, once"
    assert tokenizer.decode(ids) == ROUND_TRIP
    assert tokenizer.id_to_token(1) == "</s>"


@needs_bundled
def test_bundled_model_loads_and_generates_with_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    directory = bundled_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = tokenizer("It is a truth", return_tensors="pt").input_ids
    assert ids[0, 0].item() == tokenizer.bos_token_id == 0
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith("It is a truth")


def test_bundled_model_dir_names_the_fix_when_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import vllm_port.data as data

    monkeypatch.setattr(data, "BUNDLED_MODEL_DIR", tmp_path / "bundled-model")
    with pytest.raises(ModelLoadError, match=r"lacks config\.json.*train_bundled_model\.py"):
        data.bundled_model_dir()


# ---------------------------------------------------------------------------------------------------
# The training script, end to end on a small text
# ---------------------------------------------------------------------------------------------------

# Written for this test: two short "documents" of plain sentences, enough tokens for a few windows.
_STORY = [
    "The house stood at the end of a long lane, and the lane was lined with old trees.",
    "Every morning the sisters walked to the village, and every evening they walked home again.",
    "Their mother said that the weather would change, but it did not change for many weeks.",
    "A letter came one day from a cousin in town, and it was read aloud twice at dinner.",
    "Nobody could agree on what the letter meant, so they read it a third time after tea.",
]
SMALL_TEXT = (
    "\n\n".join(_STORY * 4) + "\n\n\f\n\n" + "\n\n".join(s.replace("sisters", "brothers") for s in _STORY * 4) + "\n"
)
TINY_MODEL = [
    *("--steps", "4", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300"),
    *("--hidden-size", "64", "--intermediate-size", "128", "--layers", "1", "--heads", "2", "--kv-heads", "1"),
    *("--eval-every", "2", "--eval-windows", "2", "--log-every", "1", "--val-fraction", "0.1", "--sample-tokens", "4"),
]


def test_training_script_writes_a_loadable_seeded_model(
    script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "small.txt.gz"
    text.write_bytes(gzip.compress(SMALL_TEXT.encode()))
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        script.main(["--text", str(text), "--out", str(out), *TINY_MODEL])
    log = capsys.readouterr().out
    assert re.search(r"step +4 +validation loss \d+\.\d+", log), log

    for out in outs:
        assert sorted(f.name for f in out.iterdir()) == [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    # seeded: the same command writes the same weights and tokenizer
    for name in ("model.safetensors", "tokenizer.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    config = load_config(outs[0])
    assert (config.num_layers, config.hidden_size, config.max_position_embeddings) == (1, 64, 32)
    assert config.dtype == torch.bfloat16
    model = load_model(outs[0], "cpu", torch.float32)
    assert model.config.vocab_size == Tokenizer.from_file(str(outs[0] / "tokenizer.json")).get_vocab_size()
    tokenizer = Tokenizer.from_file(str(outs[0] / "tokenizer.json"))
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP).ids) == ROUND_TRIP
    readme = (outs[0] / "README.md").read_text()
    assert "--steps 4" in readme and "validation" in readme and "--out" not in readme
    tokenizer_config = json.loads((outs[0] / "tokenizer_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<s>", "</s>")
    shipped = json.loads((bundled_model_dir() / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == shipped["chat_template"] == script.CHAT_TEMPLATE
    generation = json.loads((outs[0] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)


def test_training_script_refuses_text_shorter_than_a_window(script: ModuleType, tmp_path: Path) -> None:
    text = tmp_path / "short.txt"
    text.write_text("Too short to train on.\n")
    with pytest.raises(SystemExit, match="fewer than one window of --seq-len 512"):
        script.main(["--text", str(text), "--out", str(tmp_path / "m"), "--vocab-size", "270"])


def test_training_script_keeps_a_foreign_out_directory(script: ModuleType, tmp_path: Path) -> None:
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="without config.json; refusing"):
        script.save(**_save_args(script, foreign))
    assert (foreign / "keep.txt").read_text() == "mine"


def _save_args(script: ModuleType, out: Path) -> dict:
    args = script.parse_args(["--text", "unused", "--out", str(out)])
    return dict(
        args=args, model=None, tokenizer=None, config=None, n_params=0, steps=0, best=(0.0, 0), train_s=0.0, samples=[]
    )


def test_learning_rate_warms_up_then_decays_to_a_tenth(script: ModuleType) -> None:
    lr = script.learning_rate
    assert lr(0.0, 1.0, 0.1) == 0.0
    assert lr(0.05, 1.0, 0.1) == pytest.approx(0.5)
    assert lr(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert lr(1.0, 1.0, 0.1) == pytest.approx(0.1)


# ---------------------------------------------------------------------------------------------------
# --prepare, on a synthetic r-cran-janeaustenr package
# ---------------------------------------------------------------------------------------------------


def _xdr(kind: int, *, attr: bool = False, tag: bool = False) -> bytes:
    return struct.pack(">i", kind | (attr << 9) | (tag << 10))


def _r_strings(values: list[str | None]) -> bytes:
    out = _xdr(16) + struct.pack(">i", len(values))
    for v in values:
        raw = None if v is None else v.encode()
        out += _xdr(9) + (struct.pack(">i", -1) if raw is None else struct.pack(">i", len(raw)) + raw)
    return out


def _r_named_list(items: dict[str, bytes]) -> bytes:
    names = _r_strings(list(items))
    attributes = _xdr(2, tag=True) + _xdr(1) + _xdr(9) + struct.pack(">i", 5) + b"names" + names + _xdr(254)
    return _xdr(19, attr=True) + struct.pack(">i", len(items)) + b"".join(items.values()) + attributes


def _r_serialize(body: bytes) -> bytes:
    return b"X\n" + struct.pack(">iiii", 3, 0x040201, 0x030500, 5) + b"UTF-8" + body


def _ar(members: dict[str, bytes]) -> bytes:
    out = b"!<arch>\n"
    for name, data in members.items():
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
        out += header + data + (b"\n" if len(data) % 2 else b"")
    return out


def _tar_xz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_prepare_reads_the_novels_out_of_the_debian_package(script: ModuleType, tmp_path: Path) -> None:
    novels = {
        name: [name.upper(), "", "CHAPTER 1", "", "", f"A first line of {name},", "and _its_ second line.", "", "End."]
        for name in script.NOVELS
    }
    novels["emma"].append(None)  # R's NA: an empty line
    database, index = b"", {}
    for name, lines in novels.items():
        raw = _r_serialize(_r_strings(lines))
        blob = struct.pack(">i", len(raw)) + zlib.compress(raw)
        index[name] = _xdr(13) + struct.pack(">iii", 2, len(database), len(blob))
        database += blob
    rdx = _r_serialize(
        _r_named_list(
            {
                "variables": _r_named_list(index),
                "references": _r_named_list({}),
                "compressed": _xdr(10) + b"\0\0\0\1\0\0\0\1",
            }
        )
    )
    data = "./usr/lib/R/site-library/janeaustenr/data/"
    deb = tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb"
    deb.write_bytes(
        _ar(
            {
                "debian-binary": b"2.0\n",
                "control.tar.xz": _tar_xz({}),
                "data.tar.xz": _tar_xz({data + "Rdata.rdx": gzip.compress(rdx), data + "Rdata.rdb": database}),
            }
        )
    )
    out = tmp_path / "austen.txt.xz"
    script.main(["--prepare", str(out), "--deb", str(deb)])

    documents = script.split_documents(script.read_text(out))
    assert [d[0] for d in documents] == [n.upper() for n in script.NOVELS]
    assert documents[1] == [
        "PRIDEPREJUDICE",
        "CHAPTER 1",
        "A first line of prideprejudice, and its second line.",
        "End.",
    ]


def test_r_reader_refuses_what_it_does_not_know(script: ModuleType) -> None:
    with pytest.raises(ValueError, match="type 14"):
        script.RSerialReader(_r_serialize(_xdr(14) + struct.pack(">i", 0))).read()
    with pytest.raises(ValueError, match="not R XDR"):
        script.RSerialReader(b"RDX3\n")
