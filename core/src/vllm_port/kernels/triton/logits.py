"""Logits processing and logprobs in Triton: one program per row, a few passes over its vocabulary.

- ``process_logits`` (:func:`vllm_port.ops.logits.process_logits_reference`): pass 1 adds the
  bias, applies the repetition, frequency and presence penalties, writes the float32 result and keeps
  the row's maximum; pass 2, only in rows with ``min_p > 0`` and ``temperature > 0``, bans the tokens
  with ``exp((x - max) / T) < min_p`` (the probability ratio to the top token, without a softmax).
- ``top_logprobs`` (:func:`vllm_port.ops.logits.top_logprobs_reference`): pass 1 the row's
  maximum, pass 2 the sum of ``exp(x - max)``, pass 3 each logprob ``x - max - log(sum)``: the given
  token's, its rank (a count of larger ones) and, when ``num_top > 0``, the whole row for ``torch.topk``
  to take the largest from (torch selects well; the kernel does the per-token arithmetic).

No value is read on the host, so both can be captured in a device graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...ops.logits import check_process_logits, check_top_logprobs
from ..triton_target import TritonTarget
from .launch import cached_launch

__all__ = ["LogitsKernels"]


@cached_launch
@triton.jit
def _process_kernel(
    logits_ptr,  # [rows, vocab] float, unit stride along the vocabulary
    stride_row,
    bias_ptr,  # [rows, vocab] float32, contiguous
    counts_ptr,  # [rows, vocab] int32, contiguous
    prompt_ptr,  # [rows, vocab] int8 (bool), contiguous
    repetition_ptr,  # [rows] float32, and the four below
    frequency_ptr,
    presence_ptr,
    temperature_ptr,
    min_p_ptr,
    out_ptr,  # [rows, vocab] float32, contiguous
    vocab,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = row.to(tl.int64) * vocab
    lanes = tl.arange(0, BLOCK_V)
    repetition = tl.load(repetition_ptr + row)
    frequency = tl.load(frequency_ptr + row)
    presence = tl.load(presence_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    top = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        ids = start + lanes
        ok = ids < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=ok, other=0.0).to(tl.float32)
        x = x + tl.load(bias_ptr + base + ids, mask=ok, other=0.0)
        count = tl.load(counts_ptr + base + ids, mask=ok, other=0)
        in_prompt = tl.load(prompt_ptr + base + ids, mask=ok, other=0) != 0
        seen = count > 0
        penalised = tl.where(x > 0, tl.div_rn(x, repetition), x * repetition)
        x = tl.where(seen | in_prompt, penalised, x)
        x = x - frequency * count.to(tl.float32)
        x = x - tl.where(seen, presence, 0.0)
        tl.store(out_ptr + base + ids, x, mask=ok)
        top = tl.maximum(top, tl.where(ok, x, float("-inf")))
    if (temperature > 0) & (min_p > 0):
        row_max = tl.max(top, 0)
        for start in range(0, vocab, BLOCK_V):
            ids = start + lanes
            ok = ids < vocab
            x = tl.load(out_ptr + base + ids, mask=ok, other=0.0)
            ratio = tl.exp((x - row_max) / temperature)
            tl.store(out_ptr + base + ids, tl.where(ratio < min_p, float("-inf"), x), mask=ok & (ratio < min_p))


@cached_launch
@triton.jit
def _logprobs_kernel(
    logits_ptr,  # [rows, vocab] float, unit stride along the vocabulary
    stride_row,
    token_ptr,  # [rows] int64
    own_ptr,  # [rows] float32: the token's logprob
    rank_ptr,  # [rows] int64: its rank
    lp_ptr,  # [rows, vocab] float32: every logprob (written if WRITE_ALL)
    vocab,
    WRITE_ALL: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_logits = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK_V)
    top = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        ids = start + lanes
        x = tl.load(row_logits + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, x)
    row_max = tl.max(top, 0)
    total = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, vocab, BLOCK_V):
        ids = start + lanes
        x = tl.load(row_logits + ids, mask=ids < vocab, other=float("-inf")).to(tl.float32)
        total += tl.where(ids < vocab, tl.exp(x - row_max), 0.0)
    lse = row_max + tl.log(tl.sum(total, 0))
    token = tl.load(token_ptr + row)
    own = tl.load(row_logits + token).to(tl.float32) - lse
    larger = tl.zeros([BLOCK_V], tl.int64)
    for start in range(0, vocab, BLOCK_V):
        ids = start + lanes
        ok = ids < vocab
        lp = tl.load(row_logits + ids, mask=ok, other=float("-inf")).to(tl.float32) - lse
        larger += (ok & (lp > own)).to(tl.int64)
        if WRITE_ALL:
            tl.store(lp_ptr + row.to(tl.int64) * vocab + ids, lp, mask=ok)
    tl.store(own_ptr + row, own)
    tl.store(rank_ptr + row, tl.sum(larger, 0) + 1)


class LogitsKernels:
    """``process_logits`` and ``top_logprobs``, one program per row."""

    OPS = ("process_logits", "top_logprobs")

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def process_logits(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor,
        output_counts: torch.Tensor,
        prompt_mask: torch.Tensor,
        repetition_penalty: torch.Tensor,
        frequency_penalty: torch.Tensor,
        presence_penalty: torch.Tensor,
        temperature: torch.Tensor,
        min_p: torch.Tensor,
    ) -> torch.Tensor:
        """The logits ``sample`` draws from (see :func:`vllm_port.ops.logits.process_logits_reference`)."""
        check_process_logits(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty,
                             presence_penalty, temperature, min_p)  # fmt: skip
        rows, vocab = logits.shape
        out = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device)
        if rows == 0:
            return out
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        per_row = [
            t.contiguous() for t in (repetition_penalty, frequency_penalty, presence_penalty, temperature, min_p)
        ]
        _process_kernel[(rows,)](
            logits, logits.stride(0), bias.contiguous(), output_counts.contiguous(),
            prompt_mask.contiguous().view(torch.int8), *per_row, out, vocab,
            BLOCK_V=self.target.elementwise_block, num_warps=4,
        )  # fmt: skip
        return out

    def top_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's token logprob and rank, and its ``num_top`` largest (see ``top_logprobs_reference``)."""
        check_top_logprobs(logits, token_ids, num_top)
        rows, vocab = logits.shape
        device = logits.device
        own = torch.empty(rows, 1, dtype=torch.float32, device=device)
        rank = torch.empty(rows, 1, dtype=torch.int64, device=device)
        every = torch.empty(rows if num_top else 0, vocab, dtype=torch.float32, device=device)
        if rows:
            if logits.stride(1) != 1:
                logits = logits.contiguous()
            _logprobs_kernel[(rows,)](
                logits, logits.stride(0), token_ids.long().contiguous(), own, rank, every if num_top else own, vocab,
                WRITE_ALL=num_top > 0, BLOCK_V=self.target.elementwise_block, num_warps=4,
            )  # fmt: skip
        if not num_top:
            return own, rank
        top, order = every.topk(num_top, dim=-1)
        return torch.cat((own, top), dim=1), torch.cat((rank, order), dim=1)
