"""Token sampling: greedy, temperature, top-k and top-p, per request, reproducible from per-request seeds.

Randomness comes from a counter-based hash of ``(seed, token id)``, not from a stateful generator:
every provider on every device draws the same noise for the same request, the draw needs no host
synchronisation, and it traces under torch.compile. The engine passes a new seed for each step
(e.g. ``seed + step``). Sampling is the Gumbel-max trick: ``argmax(logits / T + gumbel)`` draws
from ``softmax(logits / T)`` restricted to the tokens top-k and top-p keep.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import OpInputError
from ._checks import check_float
from ._op import ErrorInput, Op, SampleInput, Tolerance

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2^27: every product of a 32-bit value with it fits in int64 without overflow


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in ``[0, 2^32)``; every provider must reproduce it bit for bit."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[num_seqs, vocab_size]`` in float32, a pure function of ``(seed, token id)``.

    ``u = (top 24 bits of hash + 0.5) / 2^24`` is exact in float32 and never 0 or 1; the noise is
    ``-log(-log(u))``.
    """
    seeds = seeds.long()
    seed_key = hash32((seeds & _MASK32) ^ hash32((seeds >> 32) & _MASK32))
    token_key = hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    bits = hash32(seed_key[:, None] ^ token_key[None, :]) >> 8
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def check_sample(logits, temperature, top_k, top_p, seeds) -> None:
    """Refuse arguments outside ``sample``'s contract (values are not checked: that would sync)."""
    check_float("sample", "logits", logits)
    if logits.dim() != 2:
        raise OpInputError(f"sample: logits has shape {tuple(logits.shape)}; it must be [num_seqs, vocab_size]")
    rows = logits.shape[0]
    for arg, t, kinds in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
        ("seeds", seeds, (torch.int64,)),
    ):
        if not isinstance(t, torch.Tensor) or t.dtype not in kinds or t.shape != (rows,):
            want = " or ".join(str(k).removeprefix("torch.") for k in kinds)
            raise OpInputError(f"sample: {arg} must be a {want} tensor of shape [{rows}] (one value per sequence)")
        if t.device != logits.device:
            raise OpInputError(
                f"sample: {arg} is on {t.device} but logits is on {logits.device}; move them to one device"
            )


def sample_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor
) -> torch.Tensor:
    """One token id per sequence (int64 ``[num_seqs]``).

    Per sequence: ``temperature == 0`` is greedy (argmax of the logits, lowest id on ties);
    otherwise logits are divided by the temperature, tokens outside the ``top_k`` largest
    (``top_k <= 0``: all) and outside the smallest set whose probability reaches ``top_p``
    (``top_p >= 1``: all; the most likely token is always kept) are removed, and a token is drawn
    with :func:`gumbel_noise` from ``seeds``.
    """
    check_sample(logits, temperature, top_k, top_p, seeds)
    vocab = logits.shape[1]
    scores = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)
    drop = rank >= k[:, None]
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]  # mass before this token already reaches top_p
    drop[:, 0] = False
    masked = torch.full_like(scores, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    drawn = (masked + gumbel_noise(seeds, vocab)).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, logits.argmax(dim=-1))


def allowed_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """``[num_seqs, vocab]`` mask of the tokens a correct sampler may return (the oracle of conformance).

    A little slack at the top-p edge (1e-4 of probability) admits providers that sum in another order.
    """
    scores = logits.double() / torch.where(temperature > 0, temperature.double(), 1.0)[:, None]
    vocab = logits.shape[1]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab)[None, :]
    k = torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)
    keep = rank < k[:, None]
    # ties with the k-th value may be kept instead of it
    kth = ordered.gather(1, (k - 1)[:, None])
    keep |= ordered >= kth
    probs = torch.softmax(ordered.masked_fill(rank >= k[:, None], float("-inf")), dim=-1)
    keep &= (probs.cumsum(dim=-1) - probs) < top_p.double()[:, None] + 1e-4
    keep[:, 0] = True
    allowed = torch.zeros_like(keep).scatter(1, order, keep)
    greedy = logits.double() == logits.double().max(dim=-1, keepdim=True).values
    return torch.where((temperature > 0)[:, None], allowed, greedy)


def _check_sampler(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """Sampling is checked by what it may return, not by value: allowed tokens, greedy exact, seeds reproducible."""
    logits, temperature, top_k, top_p, _ = args
    got = fn(*args)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or got.shape != (logits.shape[0],):
        return f"must return int64 token ids of shape [{logits.shape[0]}], got {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}"
    tokens = got.cpu()
    allowed = allowed_tokens(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu())
    if not bool((tokens >= 0).all() and (tokens < logits.shape[1]).all()):
        return f"returned ids outside the vocabulary: {tokens.tolist()}"
    bad = ~allowed.gather(1, tokens[:, None])[:, 0]
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        return f"row {row} drew token {int(tokens[row])}, which temperature/top-k/top-p exclude"
    if not torch.equal(fn(*args).cpu(), tokens):
        return "two calls with the same seeds drew different tokens"
    return None


def _samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, vocab, temperature, top_k, top_p):
        rows = len(temperature)
        logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device, dtype)
        return SampleInput(
            label,
            (
                logits,
                torch.tensor(temperature, dtype=torch.float32, device=device),
                torch.tensor(top_k, dtype=torch.int32, device=device),
                torch.tensor(top_p, dtype=torch.float32, device=device),
                torch.randint(0, 2**62, (rows,), generator=gen).to(device),
            ),
        )

    return [
        case("greedy", 100, [0.0, 0.0, 0.0], [0, 5, 0], [1.0, 1.0, 0.5]),
        case("temperature", 100, [0.5, 1.0, 2.0], [0, 0, 0], [1.0, 1.0, 1.0]),
        case("top-k", 100, [1.0, 1.0, 1.0], [1, 3, 50], [1.0, 1.0, 1.0]),
        case("top-p", 100, [1.0, 1.0, 0.7], [0, 0, 0], [0.1, 0.5, 0.9]),
        case("mixed batch", 1000, [0.0, 0.8, 1.0, 1.2], [0, 40, 0, 10], [1.0, 0.95, 0.9, 0.5]),
        case("llama3-8b vocabulary", 128256, [0.0, 0.7], [0, 50], [1.0, 0.9]),
    ]


def _errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    t, k, p = (
        torch.ones(2, device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
        torch.ones(2, device=device),
    )
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    return [
        ErrorInput("1-D logits", (logits[0], t, k, p, seeds), "[num_seqs, vocab_size]"),
        ErrorInput("temperature per batch, not per sequence", (logits, t[:1], k, p, seeds), "temperature must be"),
        ErrorInput("float top_k", (logits, t, p, p, seeds), "top_k must be"),
        ErrorInput("int32 seeds", (logits, t, k, p, k), "seeds must be"),
    ]


sample = Op(
    name="sample",
    reference=sample_reference,
    tolerances={
        dtype: Tolerance(0.0, 0.0, "checked by the allowed-token oracle, not by value")
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    },
    samples=_samples,
    errors=_errors,
    fake=lambda logits, *_args: logits.new_empty((logits.shape[0],), dtype=torch.int64),
    checker=_check_sampler,
)
