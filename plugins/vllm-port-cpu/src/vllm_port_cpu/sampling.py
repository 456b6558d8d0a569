"""CPU providers of ``sample`` (and of ``process_logits``, ``top_logprobs``: at the end): greedy, temperature, top-k and top-p for the whole batch at once.

Only the rows that truncate (top-k below the vocabulary, or top-p below 1) are sorted: on the host,
reading which rows those are costs no device sync, and a sort of the whole vocabulary per row is most
of a sampled step (200 rows of 32,000 tokens: 4x the step's time without it). The noise is the contract's shared
:func:`~vllm_port.ops.sampling.gumbel_noise`, and the arithmetic before the argmax is the
reference's (scores divided in float32), so the same seeds draw the same tokens as the reference:
a bitwise sampler, the default equivalence conformance holds it to.
"""

from __future__ import annotations

import torch

from vllm_port.ops import provider
from vllm_port.ops.logits import check_process_logits, check_top_logprobs
from vllm_port.ops.sampling import check_sample, filled_truncation, gumbel_noise

__all__ = ["process_logits", "sample", "top_logprobs"]


@provider("sample", name="cpu_sample", priority=10)
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    check_sample(logits, temperature, top_k, top_p, seeds)
    rows, vocab = logits.shape
    sampled = temperature > 0
    scores = logits.float() / torch.where(sampled, temperature, 1.0)[:, None]
    if top_k is not None or top_p is not None:  # both None: the caller says no row truncates
        top_k, top_p = filled_truncation(top_k, top_p, rows, logits.device)
        truncating = (sampled & (((top_k > 0) & (top_k < vocab)) | (top_p < 1))).nonzero().flatten()
        if truncating.numel():  # a host read of host tensors: the rows that keep every token skip the sort
            kept = _truncated(scores.index_select(0, truncating), top_k.index_select(0, truncating), top_p[truncating])
            scores.index_copy_(0, truncating, kept)
    noisy = scores.add_(gumbel_noise(seeds, vocab))
    return torch.where(sampled, noisy.argmax(dim=-1), logits.argmax(dim=-1))


def _truncated(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``scores`` (rows that truncate) with the tokens outside their top-k, then their top-p, set to -inf."""
    vocab = scores.shape[1]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scores.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp_(max=vocab)
    drop = rank >= k[:, None]  # outside the top k
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # the mass before this token already reaches top_p
    drop[:, 0] = False  # the most likely token always stays
    # back to vocabulary order as a mask (one byte a token)
    dropped = torch.empty_like(drop).scatter_(1, order, drop)
    return scores.masked_fill_(dropped, float("-inf"))


@provider("process_logits", name="cpu_process_logits", priority=10)
def process_logits(
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
    """Bias, penalties and min_p in float32, in place on one fresh buffer (the reference allocates five)."""
    check_process_logits(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty,
                         presence_penalty, temperature, min_p)  # fmt: skip
    x = logits.float().add(bias) if logits.dtype != torch.float32 else logits + bias
    seen = output_counts > 0
    repetition = repetition_penalty[:, None]
    penalised = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(seen | prompt_mask, penalised, x)
    x.sub_(frequency_penalty[:, None] * output_counts).sub_(presence_penalty[:, None] * seen)
    # min_p: p_i < min_p * p_max is exp((x_i - x_max) / T) < min_p, no softmax needed
    use = (temperature > 0) & (min_p > 0)
    ratio = ((x - x.amax(dim=-1, keepdim=True)) / torch.where(use, temperature, 1.0)[:, None]).exp_()
    # contiguous: torch keeps a strided input's layout through the element-wise ops (a no-op otherwise)
    return x.masked_fill_((ratio < min_p[:, None]) & use[:, None], float("-inf")).contiguous()


@provider("top_logprobs", name="cpu_top_logprobs", priority=10)
def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax in float32, the given token's logprob and rank, and ``torch.topk`` for the largest."""
    check_top_logprobs(logits, token_ids, num_top)
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, token_ids.long()[:, None])
    rank = (lp > own).sum(dim=-1, keepdim=True) + 1
    top, order = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], rank[:, :0])
    return torch.cat((own, top), dim=1), torch.cat((rank, order), dim=1)
