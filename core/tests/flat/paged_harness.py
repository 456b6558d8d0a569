"""A paged KV cache and the batches of one short generation, for running flat models against ``transformers``.

``Conversation`` holds sequences (token ids), hands out cache blocks in scrambled order and builds
the metadata of a prefill step (every prompt at once) and of decode steps (one token per sequence,
teacher-forced from the sequence itself), so each step's logits can be compared with one full
``transformers`` forward of each whole sequence.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from vllm_port.flat import StepInputs


@functools.cache
def hf_logits(model_dir: Path, tokens: tuple[int, ...]) -> torch.Tensor:
    """``transformers`` eager logits of every position of one sequence, float32 ``[len, vocab]``."""
    model = _hf_model(model_dir)
    with torch.no_grad():
        return model(torch.tensor(tokens)[None]).logits[0].float()


@functools.cache
def _hf_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()


class Conversation:
    """Sequences of ``lengths`` tokens: a prompt of ``lengths[i] - decode_steps`` tokens, then decode steps."""

    def __init__(self, config, lengths, decode_steps, block_size=4, seed=0, num_blocks=64):
        gen = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
        self.prompts = [n - decode_steps for n in lengths]
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_size)
        # NaN where nothing was written: a kernel reading outside a sequence poisons the logits
        self.kv_caches = [(torch.full(shape, math.nan), torch.full(shape, math.nan)) for _ in range(config.num_layers)]
        order = torch.randperm(num_blocks, generator=gen).tolist()
        per_seq = -(-max(lengths) // block_size)
        self.tables = torch.tensor(
            [order[i * per_seq : (i + 1) * per_seq] for i in range(len(lengths))], dtype=torch.int32
        )

    def _slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        return self.tables[seq, positions // self.block_size].long() * self.block_size + positions % self.block_size

    def prefill(self):
        """``(input_ids, positions, meta)`` of one prefill step over every prompt."""
        positions = [torch.arange(n) for n in self.prompts]
        ids = torch.cat([s[:n] for s, n in zip(self.seqs, self.prompts, strict=True)])
        slots = torch.cat([self._slots(i, p) for i, p in enumerate(positions)])
        cu = torch.tensor([0, *torch.tensor(self.prompts).cumsum(0).tolist()], dtype=torch.int32)
        meta = StepInputs(
            slots, self.tables, torch.tensor(self.prompts, dtype=torch.int32), cu, max(self.prompts), False
        )
        return ids, torch.cat(positions), meta

    def decode(self, step: int):
        """``(input_ids, positions, meta)`` of decode step ``step`` (0-based) for every sequence."""
        pos = torch.tensor([n + step for n in self.prompts])
        ids = torch.stack([s[p] for s, p in zip(self.seqs, pos.tolist(), strict=True)])
        slots = torch.stack([self._slots(i, pos[i : i + 1])[0] for i in range(len(self.seqs))])
        cu = torch.arange(len(self.seqs) + 1, dtype=torch.int32)
        meta = StepInputs(slots, self.tables, (pos + 1).to(torch.int32), cu, 1, True)
        return ids, pos, meta

    def expected_prefill(self, model_dir: Path) -> torch.Tensor:
        return torch.cat(
            [hf_logits(model_dir, tuple(s.tolist()))[:n] for s, n in zip(self.seqs, self.prompts, strict=True)]
        )

    def expected_decode(self, model_dir: Path, step: int) -> torch.Tensor:
        return torch.stack(
            [hf_logits(model_dir, tuple(s.tolist()))[n + step] for s, n in zip(self.seqs, self.prompts, strict=True)]
        )


def assert_fp32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the linear op's float32 tolerance (two layers in float32 stay far inside it)."""
    from vllm_port.ops import linear

    tol = linear.tolerances[torch.float32]
    torch.testing.assert_close(got.float(), want, atol=tol.atol, rtol=tol.rtol)
