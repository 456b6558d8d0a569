#!/usr/bin/env python3
"""Train the bundled default model: a tiny Llama on Jane Austen's six novels, with its own byte-level BPE.

The text
    Jane Austen's six completed novels (Sense and Sensibility 1811, Pride and Prejudice 1813,
    Mansfield Park 1814, Emma 1815, Northanger Abbey and Persuasion 1818), about 4 MB of English.
    Austen died in 1817 and every one of these books appeared by 1818: they are in the public domain
    everywhere. The transcriptions are Project Gutenberg's, as the R package ``janeaustenr`` (Julia
    Silge; MIT licence for the package itself) ships them without the Gutenberg header and licence
    text. We take them from Debian's package of it, ``r-cran-janeaustenr`` (1.0.0-1, section main), fetched
    with ``apt-get download`` (no R needed: the script reads R's lazy-load data files itself).

Two steps, because the GPU machine has no network::

    # 1. On a machine with Debian's package lists (run `apt-get update` once first): fetch and clean the text
    python dev/train_bundled_model.py --prepare dev/data/austen.txt.xz

    # 2. Anywhere, offline: train the tokenizer and the model, save a Hugging Face directory
    python dev/train_bundled_model.py --text dev/data/austen.txt.xz --device cuda --steps 2500 --minutes 4
    python dev/train_bundled_model.py --text dev/data/austen.txt.xz --device cpu --minutes 15 --batch-size 8

One H200 runs the first (about 43 passes over the novels) in a few minutes; two CPU cores in 15 minutes
see about one pass, enough to prove the pipeline but not for fluent text.

The prepared text is plain UTF-8 (optionally ``.xz`` or ``.gz`` compressed): paragraphs separated by a
blank line, documents (novels) separated by a form feed (``\\f``) on its own line. Any such file can be
passed to ``--text``.

The output (default ``core/src/vllm_port/data/bundled-model``) is what ``transformers`` and
``vllm_port.models.load_model`` both load: ``config.json`` (``LlamaForCausalLM``), ``model.safetensors``
(bfloat16), ``generation_config.json``, ``tokenizer.json`` (+ ``tokenizer_config.json``) and a ``README.md``
saying how it was made. Training is seeded; the validation loss is measured on the last paragraphs of
each novel, which training never sees, and the weights of the best validation loss are the ones saved.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import lzma
import math
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "core" / "src" / "vllm_port" / "data" / "bundled-model"
DEB_PACKAGE = "r-cran-janeaustenr"
#: R object names of the novels inside the package's data, in publication order.
NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
BOS, EOS = "<s>", "</s>"
DOCUMENT_SEPARATOR = "\f"
SAMPLE_PROMPTS = ("It is a truth universally acknowledged", "Mr. Darcy", "She was")


# ---------------------------------------------------------------------------------------------------
# --prepare: the Debian package -> the novels as plain text
# ---------------------------------------------------------------------------------------------------


def fetch_deb(cache_dir: Path) -> Path:
    """Download ``r-cran-janeaustenr``'s .deb into ``cache_dir`` with apt (no install, no R) and return it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(f"{DEB_PACKAGE}_*.deb"))
    if found:
        return found[-1]
    command = ["apt-get", "download", DEB_PACKAGE]  # a fixed command: the package name is a constant
    result = subprocess.run(command, cwd=cache_dir, capture_output=True, text=True)  # noqa: S603
    found = sorted(cache_dir.glob(f"{DEB_PACKAGE}_*.deb"))
    if result.returncode or not found:
        sys.exit(
            f"train_bundled_model: `apt-get download {DEB_PACKAGE}` failed in {cache_dir} "
            f"(exit {result.returncode}): {result.stderr.strip()}\n"
            "Run `apt-get update` once (as root) and try again, or pass a downloaded .deb with --deb FILE."
        )
    return found[-1]


def deb_members(deb: Path) -> dict[str, bytes]:
    """Files of a .deb's data archive by path (a .deb is an ``ar`` archive holding ``data.tar.*``)."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        sys.exit(f"train_bundled_model: {deb} is not a Debian package (no ar header); delete it and fetch again")
    pos = 8
    while pos + 60 <= len(blob):
        name = blob[pos : pos + 16].decode().strip().rstrip("/")
        size = int(blob[pos + 48 : pos + 58].decode().strip())
        data = blob[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are padded to an even offset
        if name.startswith("data.tar"):
            try:
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                    return {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
            except tarfile.ReadError as exc:
                sys.exit(f"train_bundled_model: cannot read {name} of {deb} ({exc}); extract it with dpkg-deb -x")
    sys.exit(f"train_bundled_model: {deb} has no data.tar member")


class RSerialReader:
    """Reads R's XDR serialization (format 2 or 3) for the few types a lazy-load data index and a
    character vector use: character vectors, lists, integer and logical vectors, pairlists, symbols."""

    _NIL, _REF = 254, 255
    _SYM, _LIST, _CHAR, _LGL, _INT, _STR, _VEC = 1, 2, 9, 10, 13, 16, 19

    def __init__(self, blob: bytes) -> None:
        self.blob, self.pos, self.refs = blob, 0, []
        if self._take(2) != b"X\n":
            raise ValueError("not R XDR serialization (expected the 'X\\n' header)")
        version = self._int()
        self._int(), self._int()  # writer's and minimal reader's R versions
        if version == 3:
            self._take(self._int())  # native encoding name

    def _take(self, n: int) -> bytes:
        out = self.blob[self.pos : self.pos + n]
        self.pos += n
        return out

    def _int(self) -> int:
        return struct.unpack(">i", self._take(4))[0]

    def read(self) -> Any:
        """The next object: str/None, list, dict of attributes under ``"attributes"`` for vectors that have them."""
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == self._NIL:
            return None
        if kind == self._REF:
            return self.refs[(flags >> 8) - 1]
        if kind == self._SYM:
            symbol = self.read()
            self.refs.append(symbol)
            return symbol
        if kind == self._CHAR:
            n = self._int()
            return None if n == -1 else self._take(n).decode("utf-8")
        if kind == self._LIST:  # pairlist: (tag, value) pairs
            attributes = self.read() if has_attr else None
            del attributes
            tag = self.read() if has_tag else None
            head, tail = self.read(), self.read()
            return [(tag, head), *(tail or [])]
        if kind in (self._STR, self._VEC, self._INT, self._LGL):
            n = self._int()
            if kind in (self._INT, self._LGL):
                values: list[Any] = list(struct.unpack(f">{n}i", self._take(4 * n)))
            else:
                values = [self.read() for _ in range(n)]
            return RVector(values, dict(self.read()) if has_attr else {})
        raise ValueError(f"R object type {kind} at byte {self.pos - 4} is not one this reader handles")


@dataclass
class RVector:
    """An R vector: its values and its attributes (``names`` among them)."""

    values: list[Any]
    attributes: dict[str, Any]


def read_r_lazyload(files: dict[str, bytes], prefix: str) -> dict[str, list[str | None]]:
    """Every object of an R package's lazy-load data (``Rdata.rdx`` index, ``Rdata.rdb`` blobs) by name."""
    index = RSerialReader(gzip.decompress(files[prefix + "Rdata.rdx"])).read()
    variables = dict(zip(index.attributes["names"].values, index.values, strict=True))["variables"]
    database = files[prefix + "Rdata.rdb"]
    objects = {}
    for name, where in zip(variables.attributes["names"].values, variables.values, strict=True):
        offset, length = where.values
        # each blob: 4-byte big-endian length of the inflated data, then a zlib stream
        blob = zlib.decompress(database[offset + 4 : offset + length])
        objects[name] = RSerialReader(blob).read().values
    return objects


def lines_to_paragraphs(lines: Sequence[str | None]) -> list[str]:
    """Gutenberg's hard-wrapped lines -> one string per paragraph; ``_italics_`` markers dropped."""
    paragraphs, current = [], []
    for line in [*lines, ""]:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(re.sub(r"\s+", " ", " ".join(current).replace("_", "")).strip())
            current = []
    return [p for p in paragraphs if p]


def prepare_text(out: Path, deb: Path | None, cache_dir: Path) -> None:
    """Write the six novels to ``out`` (.xz/.gz by suffix): paragraphs by blank lines, novels by form feeds."""
    deb = deb or fetch_deb(cache_dir)
    files = deb_members(deb)
    prefix = next((p[: -len("Rdata.rdx")] for p in files if p.endswith("janeaustenr/data/Rdata.rdx")), None)
    if prefix is None:
        sys.exit(f"train_bundled_model: {deb} holds no janeaustenr/data/Rdata.rdx; is it {DEB_PACKAGE}?")
    objects = read_r_lazyload(files, prefix)
    missing = [n for n in NOVELS if n not in objects]
    if missing:
        sys.exit(f"train_bundled_model: {deb} lacks the novels {missing}; it has {sorted(objects)}")
    documents = ["\n\n".join(lines_to_paragraphs(objects[n])) for n in NOVELS]
    text = f"\n\n{DOCUMENT_SEPARATOR}\n\n".join(documents) + "\n"
    write_text(out, text)
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"prepared {out}: {len(text):,} characters from {deb.name}, sha256 of the text {digest}")


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = text.encode("utf-8")
    if path.suffix == ".xz":
        data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    elif path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".xz":
        data = lzma.decompress(data)
    elif path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def split_documents(text: str) -> list[list[str]]:
    """Documents (form-feed separated) as lists of paragraphs (blank-line separated)."""
    documents = []
    for document in text.split(DOCUMENT_SEPARATOR):
        paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", document)]
        if paragraphs := [p for p in paragraphs if p]:
            documents.append(paragraphs)
    return documents


# ---------------------------------------------------------------------------------------------------
# Tokenizer and token streams
# ---------------------------------------------------------------------------------------------------


def train_tokenizer(documents: list[list[str]], vocab_size: int) -> Any:
    """A byte-level BPE over the paragraphs; ``<s>`` (id 0) is prepended on encode, ``</s>`` is id 1."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # each paragraph with the blank line that ends it, so that a paragraph break can become one token
    tokenizer.train_from_iterator((p + "\n\n" for d in documents for p in d), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    assert tokenizer.token_to_id(BOS) == 0 and tokenizer.token_to_id(EOS) == 1
    return tokenizer


@dataclass
class TokenStream:
    """Token ids of a run of paragraphs, and the offsets where paragraphs start (where windows may start)."""

    ids: list[int]
    paragraph_starts: list[int]


def encode_streams(tokenizer: Any, documents: list[list[str]], val_fraction: float) -> tuple[TokenStream, TokenStream]:
    """(train, validation): each document's last ``val_fraction`` of paragraphs go to validation.

    Paragraphs are joined by a blank line and documents end with ``</s>``, as in the prepared text.
    """
    separator = tokenizer.encode("\n\n", add_special_tokens=False).ids
    eos = tokenizer.token_to_id(EOS)
    train, val = TokenStream([], []), TokenStream([], [])
    for paragraphs in documents:
        n_val = min(len(paragraphs) - 1, max(1, round(len(paragraphs) * val_fraction))) if len(paragraphs) > 1 else 0
        encoded = tokenizer.encode_batch(paragraphs, add_special_tokens=False)
        first_val = len(paragraphs) - n_val
        for i, enc in enumerate(encoded):
            stream = val if i >= first_val else train
            ends_stream = i + 1 in (first_val, len(paragraphs))
            stream.paragraph_starts.append(len(stream.ids))
            stream.ids += enc.ids if ends_stream else enc.ids + separator
        for stream in (train, val):
            if stream.ids and stream.ids[-1] != eos:
                stream.ids.append(eos)
    return train, val


# ---------------------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------------------


def llama_config(args: argparse.Namespace, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # the embedding is a quarter of the model: tying it saves a megabyte or two
        bos_token_id=0,
        eos_token_id=1,
    )


def add_residual_dropout(model: Any, p: float) -> None:
    """Dropout on every residual branch (the outputs of ``o_proj`` and ``down_proj``) while training.

    Six novels are a small corpus that training sees dozens of times, and transformers' Llama has no
    dropout there; forward hooks add it without changing the module tree, so what is saved stays a
    plain ``LlamaForCausalLM`` (the hooks do nothing in eval mode).
    """
    import torch

    def hook(module: Any, inputs: Any, output: Any) -> Any:
        return torch.nn.functional.dropout(output, p, module.training)

    if p > 0:
        for layer in model.model.layers:
            layer.self_attn.o_proj.register_forward_hook(hook)
            layer.mlp.down_proj.register_forward_hook(hook)


def learning_rate(progress: float, peak: float, warmup: float) -> float:
    """Linear warm-up over the first ``warmup`` of training, then cosine decay to a tenth of ``peak``."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def training_batch(ids: Any, starts: Any, seq_len: int, generator: Any, batch: int, device: Any) -> Any:
    """``[batch, seq_len]``: ``<s>`` then ``seq_len - 1`` tokens of ``ids`` from random paragraph ``starts``."""
    import torch

    pick = starts[torch.randint(len(starts), (batch,), generator=generator)]
    ids = ids[pick[:, None] + torch.arange(seq_len - 1)]
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), ids], dim=1).to(device)


def validation_windows(stream: TokenStream, seq_len: int, limit: int) -> Any:
    """Up to ``limit`` consecutive ``<s>`` + ``seq_len - 1`` token windows covering the validation stream."""
    import torch

    width = min(seq_len - 1, len(stream.ids))
    count = max(1, min(limit, len(stream.ids) // width))
    ids = torch.as_tensor(stream.ids[: count * width]).view(count, width)
    return torch.cat([torch.zeros(count, 1, dtype=torch.long), ids], dim=1)


def evaluate(model: Any, windows: Any, batch: int, device: Any, autocast: Any) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast():
        for chunk in windows.split(batch):
            chunk = chunk.to(device)
            total += model(input_ids=chunk, labels=chunk).loss.item() * chunk.numel()
            count += chunk.numel()
    model.train()
    return total / count


def train(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    from transformers import LlamaForCausalLM

    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS reductions
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device(args.device)
    started = time.monotonic()

    text = read_text(args.text)
    documents = split_documents(text)
    if not documents:
        sys.exit(f"train_bundled_model: {args.text} holds no text")
    tokenizer = train_tokenizer(documents, args.vocab_size)
    train_stream, val_stream = encode_streams(tokenizer, documents, args.val_fraction)
    starts = torch.as_tensor(
        [s for s in train_stream.paragraph_starts if s + args.seq_len - 1 <= len(train_stream.ids)]
    )
    if not len(starts):
        sys.exit(
            f"train_bundled_model: {args.text} gives {len(train_stream.ids)} training tokens, fewer than one "
            f"window of --seq-len {args.seq_len}; pass more text or a smaller --seq-len"
        )
    train_ids = torch.as_tensor(train_stream.ids)
    val_windows = validation_windows(val_stream, args.seq_len, args.eval_windows)
    print(
        f"text {args.text}: {len(text):,} characters, {len(documents)} documents; tokenizer "
        f"{tokenizer.get_vocab_size()} tokens ({len(text) / (len(train_stream.ids) + len(val_stream.ids)):.2f} "
        f"characters a token); {len(train_stream.ids):,} training and {len(val_stream.ids):,} validation tokens "
        f"({time.monotonic() - started:.1f} s)",
        flush=True,
    )

    config = llama_config(args, tokenizer.get_vocab_size())
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())
    add_residual_dropout(model, args.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

        def autocast() -> Any:
            return torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        autocast = contextlib.nullcontext
    generator = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    steps = args.steps if args.steps is not None else 10**9
    budget_s = args.minutes * 60 if args.minutes is not None else math.inf
    print(
        f"model: {n_params:,} parameters ({config.num_hidden_layers} layers, hidden {config.hidden_size}); "
        f"{tokens_per_step:,} tokens a step on {device}; "
        + (f"{steps} steps" if args.steps is not None else "")
        + (" or " if args.steps is not None and args.minutes is not None else "")
        + (f"{args.minutes} minutes" if args.minutes is not None else ""),
        flush=True,
    )

    best = (math.inf, 0, None)  # (validation loss, step, state dict on the host)
    train_start, logged_loss, logged_steps, step, progress = time.monotonic(), 0.0, 0, 0, 0.0
    while progress < 1.0:
        # with --minutes the schedule runs on elapsed time, so the decay ends when the time does
        progress = max(step / steps, (time.monotonic() - train_start) / budget_s)
        lr = learning_rate(min(progress, 1.0), args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = training_batch(train_ids, starts, args.seq_len, generator, args.batch_size, device)
        with autocast():
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        logged_loss, logged_steps = logged_loss + loss.item(), logged_steps + 1
        progress = max(step / steps, (time.monotonic() - train_start) / budget_s)
        last = progress >= 1.0
        if step % args.log_every == 0 or last:
            elapsed = time.monotonic() - train_start
            print(
                f"step {step:6d}  train loss {logged_loss / logged_steps:.4f}  lr {lr:.2e}  "
                f"{step * tokens_per_step / elapsed:,.0f} tok/s  epoch {step * tokens_per_step / len(train_stream.ids):.2f}"
                f"  {elapsed:.0f} s",
                flush=True,
            )
            logged_loss, logged_steps = 0.0, 0
        if step % args.eval_every == 0 or last:
            val_loss = evaluate(model, val_windows, args.batch_size, device, autocast)
            if val_loss < best[0]:
                best = (val_loss, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
            print(f"step {step:6d}  validation loss {val_loss:.4f}  (best {best[0]:.4f} at step {best[1]})", flush=True)
    train_s = time.monotonic() - train_start

    model.load_state_dict(best[2])
    model.eval()
    samples = sample_texts(model, tokenizer, device, args.seed, args.sample_tokens)
    for prompt, greedy, sampled in samples:
        print(f"\n--- {prompt!r}\ngreedy : {greedy}\nsampled: {sampled}")
    save(args, model, tokenizer, config, n_params, step, best[:2], train_s, samples)


def sample_texts(model: Any, tokenizer: Any, device: Any, seed: int, new_tokens: int) -> list[tuple[str, str, str]]:
    """(prompt, greedy continuation, seeded sampled continuation) for each of :data:`SAMPLE_PROMPTS`."""
    import torch

    out = []
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
        texts = []
        for sampling in (dict(do_sample=False), dict(do_sample=True, temperature=0.8, top_k=40)):
            torch.manual_seed(seed)
            with torch.no_grad():
                new = model.generate(ids, max_new_tokens=new_tokens, pad_token_id=1, **sampling)[0, ids.shape[1] :]
            texts.append(prompt + tokenizer.decode(new.tolist()))
        out.append((prompt, texts[0], texts[1]))
    return out


#: The bundled model's chat template (LLM.chat, vllm-port serve's /v1/chat/completions): each turn as
#: 'Role: text' and a blank line, then 'Assistant:' to prompt the next turn.
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('roles are system, user and assistant; got ' + message['role']) }}{% endif %}{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"


def save(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    config: Any,
    n_params: int,
    steps: int,
    best: tuple[float, int],
    train_s: float,
    samples: list[tuple[str, str, str]],
) -> None:
    """Write the model directory next to ``--out``, then swap it in (an old one is replaced only when complete)."""
    import json

    import torch
    from transformers import GenerationConfig

    out: Path = args.out
    if out.exists() and any(out.iterdir()) and not (out / "config.json").exists():
        sys.exit(
            f"train_bundled_model: --out {out} is a non-empty directory without config.json; refusing to replace it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.to(torch.bfloat16).save_pretrained(staging)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=1).save_pretrained(staging)
    tokenizer.save(str(staging / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "model_max_length": config.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (staging / "README.md").write_text(model_readme(args, config, n_params, steps, best, train_s, samples))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    out.chmod(0o755)  # mkdtemp made it private; the files are package data, readable by all
    for f in out.iterdir():
        f.chmod(0o644)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"\nsaved {out}: {', '.join(sorted(f.name for f in out.iterdir()))} ({size / 2**20:.1f} MiB)")


def recorded_argv(argv: list[str]) -> list[str]:
    """The command line without ``--out DIR``: where a model was written says nothing about how it was made."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--out" or arg.startswith("--out="):
            skip = arg == "--out"
            continue
        kept.append(arg)
    return kept


def model_readme(
    args: argparse.Namespace,
    config: Any,
    n_params: int,
    steps: int,
    best: tuple[float, int],
    train_s: float,
    samples: list[tuple[str, str, str]],
) -> str:
    command = "python dev/train_bundled_model.py " + " ".join(shlex.quote(a) for a in recorded_argv(args.argv))
    prompt, greedy, sampled = samples[0]
    return f"""# The bundled default model of vllm-port

A tiny Llama (`LlamaForCausalLM`, {n_params:,} parameters, bfloat16 weights) with its own byte-level BPE
tokenizer ({config.vocab_size} tokens; `<s>` = 0 is prepended on encode, `</s>` = 1 ends a document), trained on
Jane Austen's six novels so that vllm-port generates readable English offline, out of the box. It is a
demonstration model: it writes pastiche Austen, not facts.

| | |
| --- | --- |
| shape | {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads of \
{config.hidden_size // config.num_attention_heads} over {config.num_key_value_heads} KV heads, MLP \
{config.intermediate_size}, tied embeddings, RoPE theta {(getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)} |
| context | {config.max_position_embeddings} tokens (the length it was trained on) |
| training | {steps} steps of {args.batch_size} x {args.seq_len} tokens on `{args.device}` in {train_s / 60:.1f} min, \
AdamW at peak lr {args.lr}, residual dropout {args.dropout}, seed {args.seed} |
| loss | validation {best[0]:.3f} nats/token (held-out last {args.val_fraction:.0%} of each novel), best at step \
{best[1]}, the weights saved |

## Training data and licence

Sense and Sensibility (1811), Pride and Prejudice (1813), Mansfield Park (1814), Emma (1815), Northanger
Abbey and Persuasion (1818), by Jane Austen (1775-1817): public domain. The text is Project Gutenberg's
transcription as shipped, without the Gutenberg header and licence, by the R package `janeaustenr`
(Julia Silge, MIT), taken from Debian's package `{DEB_PACKAGE}` by `dev/train_bundled_model.py --prepare`.
The weights and tokenizer are released with vllm-port under Apache-2.0.

## How it was made

```
{command}
```

## A sample

Prompt `{prompt}`, greedy: {greedy!r}

Sampled (temperature 0.8, top-k 40): {sampled!r}
"""


# ---------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prepare", type=Path, metavar="FILE", help="fetch and clean the novels into FILE (.xz/.gz)")
    mode.add_argument("--text", type=Path, metavar="FILE", help="train on FILE (plain, .xz or .gz)")
    parser.add_argument("--deb", type=Path, help=f"with --prepare: use this {DEB_PACKAGE} .deb, do not download")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "vllm-port", help="for the .deb")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to write (replaced)")
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 2000 when --minutes is not given)")
    parser.add_argument("--minutes", type=float, help="stop after this long; the lr schedule follows the clock")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512, help="training window; also the model's context")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=float, default=0.05, help="fraction of training spent warming up")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--dropout", type=float, default=0.1, help="on the residual branches, while training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--val-fraction", type=float, default=0.02, help="last paragraphs of each document held out")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-windows", type=int, default=64, help="validation windows evaluated")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--sample-tokens", type=int, default=48, help="tokens of each sample printed at the end")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.text is not None and args.steps is None and args.minutes is None:
        args.steps = 2000
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prepare is not None:
        prepare_text(args.prepare, args.deb, args.cache_dir)
    else:
        train(args)


if __name__ == "__main__":
    main()
