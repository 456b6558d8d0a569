"""The flat model's logits against ``transformers`` eager on the same weights, through a paged KV cache.

Every step runs the flat model with the CPU plugin's bound kernels over a paged cache whose blocks
are handed out in random order (scattered block tables) and whose unwritten slots hold NaN, so a
kernel reading outside a sequence shows it. The oracle is one full forward of each whole sequence in
``transformers``; prefill batches, decode steps and chunked prefill must all give its logits.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import save_tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import vllm_port
from vllm_port.errors import ModelLoadError
from vllm_port.models import (
    AttentionMetadata,
    LlamaModel,
    load_config,
    load_model,
    load_weights,
    rope_inverse_frequencies,
)
from vllm_port.ops import BoundOps, linear

FAMILIES = ["llama", "qwen2", "mistral"]
PADDING = -1  # a sequence id that marks a padding sequence in a step


@functools.cache
def _hf_model(model_dir: Path, dtype: torch.dtype) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=dtype).eval()


@functools.cache
def _ops(dtype: torch.dtype) -> BoundOps:
    return vllm_port.load(plugins="cpu").bind(dtype)


def hf_logits(model_dir: Path, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``transformers`` logits of every position of one whole sequence, as float32 ``[len, vocab]``."""
    with torch.no_grad():
        return _hf_model(model_dir, dtype)(tokens[None]).logits[0].float()


class PagedRun:
    """A model with a paged KV cache; ``step`` runs one packed batch of (sequence id, new tokens) chunks."""

    def __init__(self, model: LlamaModel, num_blocks: int = 48, block_size: int = 4, seed: int = 0) -> None:
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_size)
        self.model, self.block_size = model, block_size
        self.ops = _ops(model.dtype)
        self.kv_caches = [
            (torch.full(shape, math.nan, dtype=model.dtype), torch.full(shape, math.nan, dtype=model.dtype))
            for _ in range(cfg.num_layers)
        ]
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slot(self, seq: int, pos: int) -> int:
        table = self.tables.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: list[tuple[int, torch.Tensor]], is_decode: bool | None = None) -> list[torch.Tensor]:
        """Logits (float32) of every token of every chunk; a chunk of sequence ``PADDING`` is one padding token."""
        ids, positions, slots, seq_lens, q_lens = [], [], [], [], []
        for seq, tokens in chunks:
            if seq == PADDING:
                ids.append(0), positions.append(0), slots.append(-1), seq_lens.append(0), q_lens.append(1)
                continue
            start = self.lens.get(seq, 0)
            self.lens[seq] = start + len(tokens)
            ids += tokens.tolist()
            positions += range(start, start + len(tokens))
            slots += [self._slot(seq, p) for p in range(start, start + len(tokens))]
            seq_lens.append(start + len(tokens))
            q_lens.append(len(tokens))
        rows = [self.tables.get(seq, []) for seq, _ in chunks]
        width = max(map(len, rows)) + 1  # engines pad tables past the longest sequence
        tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
            max_query_len=max(q_lens),
            is_decode=all(n == 1 for n in q_lens) if is_decode is None else is_decode,
        )
        hidden = self.model.forward(self.ops, torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(self.ops, hidden).float()
        return [part for (seq, _), part in zip(chunks, logits.split(q_lens), strict=True) if seq != PADDING]


def _sequences(lengths: list[int], vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def _assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = linear.tolerances[torch.float32]  # the last op's table; two layers in fp32 stay far inside it
    torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_batch_matches_transformers_fp32(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    run = PagedRun(load_model(model_dir, torch.device("cpu"), torch.float32))
    seqs = _sequences([13, 21, 6], run.model.config.vocab_size)  # 21 tokens: past Mistral's window of 8
    for got, tokens in zip(run.step(list(enumerate(seqs))), seqs, strict=True):
        _assert_fp32_close(got, hf_logits(model_dir, tokens))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_half_precision_as_accurate_as_transformers(tiny_model_dirs, family, dtype):
    # Two half-precision implementations round differently, and after a few layers they differ by
    # more than one op's tolerance. What must hold: against the float32 oracle, the flat model in
    # half precision is as accurate as transformers in the same precision, give or take the
    # linear op's tolerance (its table's atol for this dtype).
    model_dir = tiny_model_dirs[family]
    run = PagedRun(load_model(model_dir, torch.device("cpu"), dtype))
    seqs = _sequences([17, 9], run.model.config.vocab_size, seed=1)
    for got, tokens in zip(run.step(list(enumerate(seqs))), seqs, strict=True):
        oracle = hf_logits(model_dir, tokens)
        theirs = (hf_logits(model_dir, tokens, dtype) - oracle).abs().max().item()
        ours = (got - oracle).abs().max().item()
        assert ours <= 1.5 * theirs + linear.tolerances[dtype].atol, (ours, theirs)


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_match_full_forward(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    run = PagedRun(load_model(model_dir, torch.device("cpu"), torch.float32))
    prompts, steps = [5, 12, 9], 6  # 12 + 6 tokens: Mistral's window slides during decode
    seqs = _sequences([n + steps for n in prompts], run.model.config.vocab_size, seed=2)
    run.step([(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompts, strict=True))])
    for t in range(steps):
        # one padding sequence rides along, as when a captured graph of a larger batch replays
        chunks = [(i, s[n + t : n + t + 1]) for i, (s, n) in enumerate(zip(seqs, prompts, strict=True))]
        for (i, _), got in zip(chunks, run.step([*chunks, (PADDING, None)]), strict=True):
            want = hf_logits(model_dir, seqs[i])[prompts[i] + t : prompts[i] + t + 1]
            _assert_fp32_close(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_with_cached_prefix(tiny_model_dirs, family):
    model_dir = tiny_model_dirs[family]
    run = PagedRun(load_model(model_dir, torch.device("cpu"), torch.float32), seed=3)
    a, b, c = _sequences([19, 8, 10], run.model.config.vocab_size, seed=3)
    first = run.step([(0, a[:7]), (1, b[:7])])  # a's first chunk; b's whole prompt but its last token
    # a's second chunk reads its first from the cache; b decodes one token in the prefill path; c starts
    second = run.step([(0, a[7:]), (1, b[7:]), (2, c)], is_decode=False)
    want_a, want_b, want_c = (hf_logits(model_dir, s) for s in (a, b, c))
    _assert_fp32_close(torch.cat([first[0], second[0]]), want_a)
    _assert_fp32_close(torch.cat([first[1], second[1]]), want_b)
    _assert_fp32_close(second[2], want_c)


def test_llama_attention_bias_covers_o_proj(tmp_path):
    # Llama's attention_bias gives q/k/v *and* o_proj a bias (Qwen2's stop at q/k/v)
    model_dir = save_tiny_model("llama", tmp_path, attention_bias=True, rope_scaling=None, num_hidden_layers=1)
    config = load_config(model_dir)
    assert config.attention_bias and config.o_proj_bias and config.rope_scaling is None
    run = PagedRun(load_model(model_dir, torch.device("cpu"), torch.float32))
    (tokens,) = _sequences([11], config.vocab_size)
    _assert_fp32_close(run.step([(0, tokens)])[0], hf_logits(model_dir, tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_frequencies_match_transformers(tiny_model_dirs, family):
    config = load_config(tiny_model_dirs[family])
    hf_config = transformers.AutoConfig.from_pretrained(tiny_model_dirs[family])
    rope_type = "default" if config.rope_scaling is None else config.rope_scaling["rope_type"]
    assert rope_type == ("llama3" if family == "llama" else "default")
    if rope_type == "default":
        want = 1.0 / config.rope_theta ** (torch.arange(0, config.head_size, 2, dtype=torch.float64) / config.head_size)
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    torch.testing.assert_close(rope_inverse_frequencies(config), want.double(), rtol=1e-6, atol=0)


def test_model_refuses_weights_it_cannot_use(llama_dir):
    config = load_config(llama_dir)
    weights = load_weights(llama_dir, config, torch.device("cpu"), torch.float32)
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.mlp.up_proj.weight' is missing"):
        LlamaModel(config, {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"})
    mixed = dict(weights, **{"model.norm.weight": weights["model.norm.weight"].half()})
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' is torch.float16 .* one dtype"):
        LlamaModel(config, mixed)
    count = len(weights)
    LlamaModel(config, weights)  # not consumed: the caller's dict stays whole
    assert len(weights) == count
    LlamaModel(config, weights, consume=True)  # consumed: the unfused parts are the caller's no more
    assert weights == {}
