"""Token sampling in Triton: temperature, the Gumbel-max draw and the argmax fused in one pass.

:func:`vllm_port.ops.sampling.sample_reference` draws ``argmax(logits / T + gumbel)`` over the
tokens top-k and top-p keep, the noise a hash of ``(seed, token id)``. Here:

1. torch decides, per row, what top-k/top-p keep, exactly as the reference does (a stable
   descending sort, a softmax and a cumulative sum: torch does these well). The kept tokens are
   a prefix of that sort order, so the decision shrinks to the last kept entry: its score and
   token id. A token is kept when its score is greater, or equal with an id no larger (the stable
   sort puts equal scores in id order). Which rows need it the provider cannot tell without
   reading the GPU, so the sort runs for every row, unless the caller passes ``top_k`` and ``top_p``
   as ``None`` (no row truncates): then there is no sort, and every token is kept.
2. One Triton pass over the vocabulary per row scales the logits by the temperature, applies
   that threshold, adds the Gumbel noise (the reference's hash, reproduced bit for bit) and keeps a
   running argmax; greedy rows (``temperature <= 0``) take the plain argmax of the logits and skip
   the noise. Long vocabularies are split across programs when rows are few (a small kernel then
   picks the best of the splits); tiny vocabularies put several rows in one program. Ties go to
   the lowest token id everywhere, as in ``torch.argmax``.

No value is read on the host: the grid comes from shapes alone, so the call can be captured in a
CUDA graph, and the number of splits is a runtime argument, so batch sizes do not recompile.

A bitwise sampler (the default equivalence): the keep decisions and scores are the reference's
bit for bit, and only ``tl.log`` may round the noise a few ulps away from torch's ``log``, which
the contract's score margin allows (see :mod:`vllm_port.ops.sampling`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...device_properties import compute_units
from ...ops.sampling import check_sample, filled_truncation
from ..triton_target import TritonTarget
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["SamplingKernels"]

_MIN_SPLIT_TOKENS = 4096  # a vocabulary split scans at least this many tokens
_MAX_SPLITS = 64
_INT32_MAX = 2**31 - 1


@triton.jit
def _hash32(x):
    """``vllm_port.ops.sampling.hash32`` on uint32 values.

    The reference multiplies in int64 and keeps the low 32 bits; the low 32 bits of a product
    depend only on the low 32 bits of its factors, so uint32 multiplication (which wraps) gives the
    same bits with 32-bit instructions. ``>>`` on unsigned values is the logical shift.
    """
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _gumbel(seed_key, token_ids):
    """Gumbel(0, 1) noise of ``token_ids`` for a row whose ``seed_key`` is ``hash32(lo ^ hash32(hi))``."""
    bits = _hash32(seed_key ^ _hash32(token_ids.to(tl.uint32))) >> 8  # the top 24 bits
    u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)  # exact, in (0, 1)
    return -tl.log(-tl.log(u))


@cached_launch
@triton.jit
def _sample_kernel(
    logits_ptr,  # [num_seqs, vocab] float32/bfloat16/float16, unit stride along the vocabulary
    stride_row,
    temperature_ptr,  # [num_seqs] float32; <= 0 is greedy
    seeds_ptr,  # [num_seqs] int64 per-row seeds of the noise
    keep_score_ptr,  # [num_seqs] float32 score of the last token top-k/top-p keep (in sort order)
    keep_id_ptr,  # [num_seqs] int64 its token id: equal scores are kept up to this id
    out_ptr,  # [num_seqs] int64 drawn token (written unless SPLIT)
    part_score_ptr,  # [num_seqs, num_splits] float32 best noisy score of each split
    part_id_ptr,  # [num_seqs, num_splits] int32 its token id
    num_seqs,
    vocab,
    chunk,  # tokens per split, a multiple of BLOCK_V
    num_splits,  # programs sharing one row's vocabulary (runtime: batch sizes do not recompile)
    ROWS: tl.constexpr,  # rows per program: 1 for real vocabularies, more when they are tiny
    SPLIT: tl.constexpr,  # num_splits > 1: write per-split bests for _merge_splits_kernel
    TRUNCATE: tl.constexpr,  # some row may truncate: read keep_score/keep_id (else every token is kept)
    BLOCK_V: tl.constexpr,  # tokens per row and loop step
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    split = tl.program_id(1)
    row_ok = rows < num_seqs
    begin = split * chunk
    end = tl.minimum(begin + chunk, vocab)
    lanes = tl.arange(0, BLOCK_V)
    row_logits = logits_ptr + rows.to(tl.int64)[:, None] * stride_row

    temperature = tl.load(temperature_ptr + rows, mask=row_ok, other=0.0)
    sampled = temperature > 0  # the other rows are greedy: plain argmax of the logits
    divisor = tl.where(sampled, temperature, 1.0)[:, None]
    if TRUNCATE:
        keep_score = tl.load(keep_score_ptr + rows, mask=row_ok, other=0.0)[:, None]
        keep_id = tl.load(keep_id_ptr + rows, mask=row_ok, other=0)[:, None]
    else:  # the lowest score and the largest id: every token in the vocabulary is kept
        keep_score = tl.full([ROWS, 1], float("-inf"), tl.float32)
        keep_id = tl.full([ROWS, 1], 2147483647, tl.int64)
    seed = tl.load(seeds_ptr + rows, mask=row_ok, other=0)
    seed_key = _hash32(seed.to(tl.uint32) ^ _hash32((seed >> 32).to(tl.uint32)))[:, None]

    # Each lane keeps its best (score, id); ties keep the earlier (smaller) id.
    best = tl.full([ROWS, BLOCK_V], float("-inf"), tl.float32)
    best_id = tl.zeros([ROWS, BLOCK_V], tl.int32) + (begin + lanes)[None, :]
    if tl.max(sampled.to(tl.int32), 0) > 0:
        for start in range(begin, end, BLOCK_V):
            ids = (start + lanes)[None, :]
            in_vocab = ids < end
            x = tl.load(row_logits + ids, mask=row_ok[:, None] & in_vocab, other=float("-inf")).to(tl.float32)
            # IEEE division: bit-equal to torch's logits.float() / T, so the threshold compares exactly
            scaled = tl.div_rn(x, divisor)
            kept = in_vocab & ((scaled > keep_score) | ((scaled == keep_score) & (ids <= keep_id)))
            noisy = tl.where(kept, scaled + _gumbel(seed_key, ids), float("-inf"))
            score = tl.where(sampled[:, None], noisy, x)
            better = score > best
            best = tl.where(better, score, best)
            best_id = tl.where(better, ids, best_id)
    else:  # only greedy rows here: skip the noise
        for start in range(begin, end, BLOCK_V):
            ids = (start + lanes)[None, :]
            x = tl.load(row_logits + ids, mask=row_ok[:, None] & (ids < end), other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            best_id = tl.where(better, ids, best_id)

    top = tl.max(best, 1)
    top_id = tl.min(tl.where(best == top[:, None], best_id, 2147483647), 1)
    if SPLIT:
        tl.store(part_score_ptr + rows * num_splits + split, top, mask=row_ok)
        tl.store(part_id_ptr + rows * num_splits + split, top_id, mask=row_ok)
    else:
        tl.store(out_ptr + rows, top_id.to(tl.int64), mask=row_ok)


@cached_launch
@triton.jit
def _merge_splits_kernel(
    part_score_ptr,  # [num_seqs, num_splits] float32
    part_id_ptr,  # [num_seqs, num_splits] int32
    out_ptr,  # [num_seqs] int64
    num_splits,
    SPLITS_PAD: tl.constexpr,  # num_splits rounded up to a power of two
):
    """One program per row: the best split, the lowest id among equal scores (splits are in id order)."""
    row = tl.program_id(0)
    offs = tl.arange(0, SPLITS_PAD)
    valid = offs < num_splits
    score = tl.load(part_score_ptr + row * num_splits + offs, mask=valid, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * num_splits + offs, mask=valid, other=2147483647)
    top = tl.max(score, 0)
    tl.store(out_ptr + row, tl.min(tl.where(score == top, ids, 2147483647), 0).to(tl.int64))


def _num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` as the platform says (no sync); a few for the CPU interpreter."""
    return compute_units(device, default=4)


def _vocab_splits(programs: int, vocab: int, block_v: int, num_sms: int) -> tuple[int, int]:
    """``(splits, chunk)``: enough programs for about two per SM, each scanning >= _MIN_SPLIT_TOKENS tokens."""
    splits = max(1, min(cdiv(2 * num_sms, max(programs, 1)), cdiv(vocab, _MIN_SPLIT_TOKENS), _MAX_SPLITS))
    chunk = cdiv(cdiv(vocab, splits), block_v) * block_v
    return cdiv(vocab, chunk), chunk


def _kept_threshold(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the score and token id of the last token top-k/top-p keep, decided as the reference does.

    Same torch calls as ``sample_reference``, so the same keep/drop decisions; instead of
    scattering a masked copy of the logits back, only the boundary of the kept prefix is returned.
    """
    vocab = logits.shape[1]
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)
    drop = rank >= k[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    # the kept entries are a prefix (rank 0 always in it): its last rank is the largest kept one
    last = torch.where(drop, 0, rank).amax(dim=-1, keepdim=True)
    return ordered.gather(1, last)[:, 0], order.gather(1, last)[:, 0]


class SamplingKernels:
    """Greedy, temperature, top-k and top-p sampling with counter-based noise, one fused pass per row."""

    OPS = ("sample",)

    def __init__(self, target: TritonTarget) -> None:
        self.target = target

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        seeds: torch.Tensor,
    ) -> torch.Tensor:
        """One token id per sequence (see :func:`vllm_port.ops.sampling.sample_reference`)."""
        check_sample(logits, temperature, top_k, top_p, seeds)
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
        if rows == 0 or vocab == 0:
            return out.zero_()
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        # the kernel reads one entry per row at +1: a strided view (found by fuzzing) drew from other memory's seeds
        temperature, seeds = temperature.contiguous(), seeds.contiguous()
        truncate = top_k is not None or top_p is not None
        if truncate:  # a sort of every row (most of the call's time): only when the caller says a row may truncate
            top_k, top_p = filled_truncation(top_k, top_p, rows, logits.device)
            keep_score, keep_id = _kept_threshold(logits, temperature, top_k, top_p)
        else:
            keep_score = keep_id = out  # unused
        block = self.target.elementwise_block
        rows_per_program = max(1, block // next_power_of_2(max(vocab, 16)))  # tiny vocabularies share a program
        block_v = block // rows_per_program
        programs = cdiv(rows, rows_per_program)
        splits, chunk = _vocab_splits(programs, vocab, block_v, _num_sms(logits.device))
        if splits > 1:
            part_score = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
            part_id = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
        else:
            part_score = part_id = out  # unused
        _sample_kernel[(programs, splits)](
            logits, logits.stride(0), temperature, seeds, keep_score, keep_id, out, part_score, part_id,
            rows, vocab, chunk, splits,
            ROWS=rows_per_program,
            SPLIT=splits > 1,
            TRUNCATE=truncate,
            BLOCK_V=block_v,
            num_warps=4,
        )  # fmt: skip
        if splits > 1:
            _merge_splits_kernel[(rows,)](
                part_score, part_id, out, splits, SPLITS_PAD=next_power_of_2(splits), num_warps=1
            )
        return out

    def gumbel_noise(self, seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The noise the sampler adds, ``[num_seqs, vocab_size]`` float32 (for tests against the reference's)."""
        out = torch.empty(seeds.shape[0], vocab_size, dtype=torch.float32, device=seeds.device)
        if out.numel():
            block_v = self.target.elementwise_block
            _noise_kernel[(seeds.shape[0], cdiv(vocab_size, block_v))](
                seeds, out, vocab_size, BLOCK_V=block_v, num_warps=4
            )
        return out


@cached_launch
@triton.jit
def _noise_kernel(seeds_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    """Writes ``_gumbel`` for one block of one row (testing only)."""
    row = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    seed = tl.load(seeds_ptr + row)
    seed_key = _hash32(seed.to(tl.uint32) ^ _hash32((seed >> 32).to(tl.uint32)))
    tl.store(out_ptr + row.to(tl.int64) * vocab + ids, _gumbel(seed_key, ids), mask=ids < vocab)
