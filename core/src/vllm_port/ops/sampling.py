"""Token sampling: greedy, temperature, top-k and top-p, per request, reproducible from per-request seeds.

Randomness comes from a counter-based hash of ``(seed, token id)``, not from a stateful generator:
every provider on every device draws the same noise for the same request, the draw needs no host
synchronisation, and it traces under torch.compile. The engine passes a new seed for each step
(e.g. ``seed + step``). Sampling is the Gumbel-max trick: ``argmax(logits / T + gumbel)`` draws
from ``softmax(logits / T)`` restricted to the tokens top-k and top-p keep.

``top_k`` and ``top_p`` may each be ``None``, as in vLLM's sampler: no row truncates by it (every
row's top-k is 0, every row's top-p is 1). The caller knows that on the host, where a provider
could only learn it by reading the device; with both ``None`` a provider skips the work top-k and
top-p take (on a GPU, a sort of every row's vocabulary: most of a sampled step's sampler).

How conformance judges a provider (every rule below names the check that enforces it):

- **Every provider** returns int64 ids, only tokens temperature/top-k/top-p allow, the exact argmax
  (lowest id on ties) on greedy rows, the same draws for the same seeds, and a draw of a request
  that depends on its own row alone (logits, parameters, seed): not on its position in the batch,
  not on another request's seed (``sample.check``).
- **Bitwise** providers (``Provider.equivalence == "bitwise"``, the default) draw what
  :func:`sample_reference` draws from the same seeds (:func:`check_reference_draws`). Scores are
  the logits converted to float32 and divided by the temperature in float32 (IEEE division:
  bf16/fp16 logits are never scaled in their own dtype, whose rounding moves a score by 0.4%);
  top-k keeps the k highest scores, ties at the k-th score keeping the lowest ids; the noise is
  :func:`gumbel_noise`. Two roundings may differ between devices, and only there may a draw
  differ: the probability mass before a token, a softmax summed in another order, may land on
  the other side of ``top_p`` when it lies within :data:`TOP_P_SLACK` of it; and a perturbed
  score ``score + noise`` may differ by a few ulps (another ``log``, a multiply by ``1 / T``, a
  fused add), so a token whose perturbed score is within :data:`SCORE_MARGIN` ``* (1 + |score| +
  |noise|)`` of the best one may be drawn instead. Both are rare (no row of the op's 606 sample
  rows comes that close); a wrong temperature, top-k, top-p or seed moves scores by far more.
- **Statistical** providers (``equivalence == "statistical"``, e.g. a vendor sampler drawing from
  the device's own generator keyed by the request's seed) draw from the reference's
  distribution: a G-test of many draws against ``softmax(logits / T)`` over the kept tokens
  rejects them at :data:`DISTRIBUTION_SIGNIFICANCE` (:func:`check_draw_distribution`, cases
  from :func:`distribution_samples`). They still honour the seeds as above: reproducible, one
  request's seed affects only its own draw.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import OpInputError
from ._checks import check_float, first_bad, reads_values
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants

__all__ = [
    "DISTRIBUTION_SIGNIFICANCE",
    "EQUIVALENCES",
    "SCORE_MARGIN",
    "TOP_P_SLACK",
    "acceptable_draws",
    "allowed_tokens",
    "check_draw_distribution",
    "check_reference_draws",
    "check_sample",
    "distribution_samples",
    "filled_truncation",
    "gumbel_noise",
    "hash32",
    "reference_probabilities",
    "sample",
    "sample_reference",
]

#: How a provider may reproduce ``sample``'s reference (``Provider.equivalence``).
EQUIVALENCES = ("bitwise", "statistical")
#: Probability mass by which a correct provider's top-p decision may differ from the reference's
#: (a float32 softmax and cumulative sum, in any order, err by up to 1.5e-5 over 152k tokens).
TOP_P_SLACK = 1e-4
#: Relative rounding allowed between a provider's perturbed scores and the reference's: 2^7 float32
#: ulps, room for a different ``log`` in the noise, ``x * (1 / T)`` for ``x / T`` and a fused add;
#: a bf16-rounded score (2^-9) or a temperature off by 1% is far outside.
SCORE_MARGIN = 2.0**-16
#: Significance of the goodness-of-fit test of statistical providers, per case and dtype: a correct
#: sampler fails one case in ten million; a temperature off by 5% fails with near certainty.
DISTRIBUTION_SIGNIFICANCE = 1e-7

_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2^27: every product of a 32-bit value with it fits in int64 without overflow
_RESEED = 0x5DEECE66D  # xor-ed into some rows' seeds to check that other rows do not move


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in ``[0, 2^32)``; every provider must reproduce it bit for bit."""
    x = (x >> 16) ^ x  # a new tensor: the caller's is never written; the rest works in place (2x faster)
    x.mul_(_MIX).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16).mul_(_MIX).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def gumbel_noise(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[num_seqs, vocab_size]`` in float32, a pure function of ``(seed, token id)``.

    ``u = (top 24 bits of hash + 0.5) / 2^24`` is exact in float32 and never 0 or 1; the noise is
    ``-log(-log(u))``.
    """
    seeds = seeds.long()
    seed_key = hash32((seeds & _MASK32) ^ hash32((seeds >> 32) & _MASK32))
    token_key = hash32(torch.arange(vocab_size, device=seeds.device, dtype=torch.int64))
    bits = hash32(seed_key[:, None] ^ token_key[None, :]).bitwise_right_shift_(8)
    u = bits.to(torch.float32).add_(0.5).mul_(1.0 / (1 << 24))
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


def filled_truncation(
    top_k: torch.Tensor | None, top_p: torch.Tensor | None, rows: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` and ``top_p`` as tensors: ``None`` becomes top-k 0 and top-p 1 for each of the ``rows`` (no truncation)."""
    if top_k is None:
        top_k = torch.zeros(rows, dtype=torch.int32, device=device)
    if top_p is None:
        top_p = torch.ones(rows, dtype=torch.float32, device=device)
    return top_k, top_p


def check_sample(logits, temperature, top_k, top_p, seeds) -> None:
    """Refuse arguments outside ``sample``'s contract; parameter values and NaN logits are checked under validation."""
    check_float("sample", "logits", logits)
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise OpInputError(
            f"sample: logits has shape {tuple(logits.shape)}; it must be [num_seqs, vocab_size] with vocab_size >= 1"
        )
    rows = logits.shape[0]
    for arg, t, kinds in (
        ("temperature", temperature, (torch.float32,)),
        ("top_k", top_k, (torch.int32, torch.int64)),
        ("top_p", top_p, (torch.float32,)),
        ("seeds", seeds, (torch.int64,)),
    ):
        if t is None and arg in ("top_k", "top_p"):
            continue  # no row truncates by it
        if not isinstance(t, torch.Tensor) or t.dtype not in kinds or t.shape != (rows,):
            want = " or ".join(str(k).removeprefix("torch.") for k in kinds)
            optional = ", or None when no row truncates by it" if arg in ("top_k", "top_p") else ""
            raise OpInputError(
                f"sample: {arg} must be a {want} tensor of shape [{rows}] (one value per sequence){optional}"
            )
        if t.device != logits.device:
            raise OpInputError(
                f"sample: {arg} is on {t.device} but logits is on {logits.device}; move them to one device"
            )
    if reads_values(logits, temperature):
        _check_sample_values(logits, temperature, top_p)


def _check_sample_values(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None) -> None:
    """Values: temperatures finite and >= 0, top_p in (0, 1], no NaN logit. Every top_k has a meaning (<= 0: all)."""
    checks = [
        (
            "temperature",
            temperature,
            ~(temperature.isfinite() & (temperature >= 0)),
            "a finite number >= 0 (0 is greedy)",
        )
    ]
    if top_p is not None:
        checks.append(("top_p", top_p, ~((top_p > 0) & (top_p <= 1)), "in (0, 1] (1 keeps every token)"))
    for arg, t, bad, rule in checks:
        at = first_bad(bad)
        if at is not None:
            raise OpInputError(f"sample: {arg}[{at[0]}] is {float(t[at]):g}; it must be {rule}")
    at = first_bad(logits.isnan())
    if at is not None:
        raise OpInputError(
            f"sample: logits[{at[0]}, {at[1]}] is NaN; the model produced NaN for sequence {at[0]} (a broken kernel "
            "or overflow upstream): no token can be drawn from it"
        )


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """One token id per sequence (int64 ``[num_seqs]``).

    Per sequence: ``temperature == 0`` is greedy (argmax of the logits, lowest id on ties);
    otherwise logits are divided by the temperature (in float32), tokens outside the ``top_k``
    largest (``top_k <= 0``: all; ties at the k-th score keep the lowest ids) and outside the
    smallest set whose probability reaches ``top_p`` (in (0, 1]; 1: all; the most likely token is
    always kept) are removed, and a token is drawn with :func:`gumbel_noise` from ``seeds``.
    ``top_k``/``top_p`` ``None``: no row truncates by it.
    """
    check_sample(logits, temperature, top_k, top_p, seeds)
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    vocab = logits.shape[1]
    scores = _scores(logits, temperature)
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


def _scores(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """The reference's scores: the logits in float32 divided by the temperature in float32 (by 1 on greedy rows)."""
    return logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]


def _kept(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, slacks: tuple[float, ...], ties: bool
) -> list[torch.Tensor]:
    """Per slack, ``[rows, vocab]``: the tokens top-k then top-p keep, in vocabulary order, the mass summed in float64.

    A slack moves ``top_p`` (``+``: a token at the edge may be kept, ``-``: it must be); ``ties``
    also keeps every token tied with the k-th score when that one is kept (any of them may be it).
    One sort serves every slack.
    """
    vocab = scores.shape[1]
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scores.device)[None, :]
    last = torch.where(top_k > 0, top_k.long(), vocab).clamp(max=vocab)[:, None] - 1
    in_top_k = rank <= last
    probs = torch.softmax(ordered.double().masked_fill(~in_top_k, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    masks = []
    for slack in slacks:
        keep = in_top_k & (before < top_p.double()[:, None] + slack)
        keep[:, 0] = True
        if ties:
            keep |= (ordered == ordered.gather(1, last)) & keep.gather(1, last)
        masks.append(torch.empty_like(keep).scatter_(1, order, keep))
    return masks


def allowed_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``[num_seqs, vocab]`` mask of the tokens any correct sampler may return, bitwise or statistical.

    Sampled rows: what top-k and top-p keep, with :data:`TOP_P_SLACK` at the top-p edge and any token
    tied with the k-th score; greedy rows: every maximal logit. ``top_k``/``top_p`` may be ``None``, as for ``sample``.
    """
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    (kept,) = _kept(_scores(logits, temperature), top_k, top_p, (TOP_P_SLACK,), ties=True)
    greedy = logits == logits.max(dim=-1, keepdim=True).values
    return torch.where((temperature > 0)[:, None], kept, greedy)


def acceptable_draws(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """``[num_seqs, vocab]`` mask of the tokens a bitwise provider may draw: in nearly every row only the reference's.

    A token qualifies when a provider could draw it by rounding alone (see the module's docstring):
    it may be kept (top-p at :data:`TOP_P_SLACK`), and its perturbed score, raised by the margin,
    reaches the best perturbed score, lowered by the margin, of the tokens that must be kept. Greedy
    rows: the first maximal logit only.
    """
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    scores = _scores(logits, temperature)
    surely, maybe = _kept(scores, top_k, top_p, (-TOP_P_SLACK, TOP_P_SLACK), ties=False)
    noise = gumbel_noise(seeds, logits.shape[1]).double()
    perturbed = scores.double() + noise
    margin = SCORE_MARGIN * (1.0 + scores.double().abs() + noise.abs())
    floor = (perturbed - margin).masked_fill(~surely, float("-inf")).amax(dim=-1, keepdim=True)
    sampled = maybe & (perturbed + margin >= floor)
    greedy = torch.zeros_like(sampled).scatter(1, logits.argmax(dim=-1, keepdim=True), True)
    return torch.where((temperature > 0)[:, None], sampled, greedy)


def _output_problem(got: Any, rows: int, vocab: int) -> str | None:
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or got.shape != (rows,):
        return f"must return int64 token ids of shape [{rows}], got {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}"
    tokens = got.cpu()
    if not bool((tokens >= 0).all() and (tokens < vocab).all()):
        return f"returned ids outside the vocabulary [0, {vocab}): {tokens.tolist()[:16]}"
    return None


def _on_host(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """``sample``'s arguments on the host, a ``None`` top_k/top_p filled in (what the oracles read)."""
    logits, temperature, top_k, top_p, seeds = args
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    return tuple(a.cpu() for a in (logits, temperature, top_k, top_p, seeds))


def _flipped(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.flip(0)


def _row(args: tuple[Any, ...], row: int) -> str:
    _, temperature, top_k, top_p, seeds = args
    return (
        f"row {row} (temperature {float(temperature[row]):g}, top_k {int(top_k[row])}, "
        f"top_p {float(top_p[row]):g}, seed {int(seeds[row])})"
    )


def _reseed_odd_rows(seeds: torch.Tensor) -> torch.Tensor:
    odd = torch.arange(seeds.shape[0], device=seeds.device) % 2 == 1
    return torch.where(odd, seeds ^ _RESEED, seeds)


def _check_sampler(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """What every sampler must do, bitwise or statistical: allowed tokens, exact greedy rows, draws a row's own.

    Three calls: as given; again (the same seeds draw the same tokens); with the batch in reverse
    order and the odd rows' seeds changed (the even rows must draw what they drew: a draw depends
    neither on the row's position nor on another row's seed).
    """
    logits, temperature, top_k, top_p, seeds = args
    got = fn(*args)
    problem = _output_problem(got, *logits.shape)
    if problem:
        return problem
    tokens, host = got.cpu(), _on_host(args)
    bad = ~allowed_tokens(*host[:4]).gather(1, tokens[:, None])[:, 0]
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        return (
            f"{_row(host, row)} drew token {int(tokens[row])}, which temperature/top-k/top-p exclude "
            f"({int(bad.sum())} of {len(tokens)} rows drew excluded tokens)"
        )
    argmax = host[0].argmax(dim=-1)
    wrong = (host[1] <= 0) & (tokens != argmax)
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        return (
            f"row {row} is greedy (temperature 0) and drew token {int(tokens[row])}; the argmax of its "
            f"logits, the lowest id on ties, is {int(argmax[row])}"
        )
    again = fn(*args).cpu()
    if not torch.equal(again, tokens):
        row = int((again != tokens).nonzero()[0])
        return (
            f"two calls with the same seeds drew different tokens ({_row(host, row)}: {int(tokens[row])}, then "
            f"{int(again[row])}); draws must follow from the seeds, not from a generator's state"
        )
    # reversed rows, odd rows (in the original order) reseeded: a row keeping its seed must keep its draw
    reseeded = _reseed_odd_rows(seeds)
    moved = fn(logits.flip(0), temperature.flip(0), _flipped(top_k), _flipped(top_p), reseeded.flip(0)).cpu().flip(0)
    wrong = (moved != tokens) & (reseeded.cpu() == host[4])
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        return (
            f"{_row(host, row)} drew token {int(tokens[row])}, and token {int(moved[row])} once the batch was "
            "reversed and the odd rows' seeds changed (its own seed unchanged); a request's draw must depend only "
            "on its own logits, parameters and seed, not on its position or another request's seed"
        )
    return None


def check_reference_draws(fn: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """The bitwise contract: ``fn`` draws what :func:`sample_reference` draws from the same seeds; ``None`` if so.

    Up to the roundings the module's docstring allows (:func:`acceptable_draws`). Every row has its
    own seed, so each row of each sample checks another seed.
    """
    got = fn(*args)
    problem = _output_problem(got, *args[0].shape)
    if problem:
        return problem
    tokens, host = got.cpu(), _on_host(args)
    ok = acceptable_draws(*host).gather(1, tokens[:, None])[:, 0]
    return None if bool(ok.all()) else _not_the_reference(host, tokens, ok)


def _not_the_reference(host: tuple[torch.Tensor, ...], tokens: torch.Tensor, ok: torch.Tensor) -> str:
    logits, temperature = host[:2]
    row = int((~ok).nonzero()[0])
    got, want = int(tokens[row]), int(sample_reference(*host)[row])
    differ = f"{int((~ok).sum())} of {len(tokens)} rows differ from the reference"
    if temperature[row] <= 0:
        return f"row {row} is greedy (temperature 0) and drew token {got}; the reference's argmax is {want}; {differ}"
    one = tuple(a[row : row + 1] for a in host)
    if not bool(_kept(_scores(*one[:2]), *one[2:4], (TOP_P_SLACK,), ties=False)[0][0, got]):
        why = "which top-k/top-p exclude"
    else:
        scores = _scores(*one[:2])[0].double()
        perturbed = scores + gumbel_noise(one[4], logits.shape[1])[0].double()
        why = (
            f"whose perturbed score (logits / T + noise) {float(perturbed[got]):.7g} is "
            f"{float(perturbed[want] - perturbed[got]):.3g} below the reference's token's, beyond rounding"
        )
    return (
        f"{_row(host, row)} drew token {got}, {why}; the reference draws {want} from that seed; {differ}. A bitwise "
        "provider must reproduce the reference's scores and noise (vllm_port.ops.sampling); a sampler with its own "
        "generator declares equivalence='statistical'"
    )


_DISTRIBUTION_SEED = 20240611
#: A row of 32 logits on three levels (so that the temperature moves mass between them), exact in
#: bf16 and fp16, and no top-k/top-p edge of the cases below within 0.01 of its threshold.
_DISTRIBUTION_LOGITS = (
    [3.0 - i / 16 for i in range(4)] + [1.5 - i / 16 for i in range(8)] + [-i / 16 for i in range(20)]
)
#: (label, temperature, top_k, top_p, draws): 50000 draws catch a temperature off by 5%, 20000 one off by 10%.
_DISTRIBUTION_CASES = (
    ("temperature 0.7", 0.7, 0, 1.0, 50_000),
    ("temperature 1.5", 1.5, 0, 1.0, 50_000),
    ("top-k 5", 1.0, 5, 1.0, 20_000),
    ("top-p 0.6", 1.0, 0, 0.6, 20_000),
    ("temperature 1.2, top-k 12, top-p 0.9", 1.2, 12, 0.9, 20_000),
    ("engine defaults: top_k -1, top_p 1", 1.0, -1, 1.0, 20_000),
    ("nothing truncated: top_k and top_p None", 1.0, None, None, 20_000),
)


def distribution_samples(dtype: torch.dtype, device: torch.device) -> list[SampleInput]:
    """The cases of :func:`check_draw_distribution`: one row of logits and parameters, repeated with fresh seeds."""
    gen = torch.Generator().manual_seed(_DISTRIBUTION_SEED)
    row = torch.tensor(_DISTRIBUTION_LOGITS)[torch.randperm(len(_DISTRIBUTION_LOGITS), generator=gen)]
    cases = []
    for label, temperature, top_k, top_p, draws in _DISTRIBUTION_CASES:
        args = (
            row.to(device, dtype).expand(draws, -1).contiguous(),
            torch.full((draws,), temperature, device=device),
            None if top_k is None else torch.full((draws,), top_k, dtype=torch.int32, device=device),
            None if top_p is None else torch.full((draws,), top_p, device=device),
            torch.randint(-(2**63), 2**63 - 1, (draws,), generator=gen, dtype=torch.int64).to(device),
        )
        cases.append(SampleInput(label, args))
    return cases


def reference_probabilities(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """``[num_seqs, vocab]`` float64: the distribution :func:`sample_reference` draws from (0 where greedy)."""
    top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
    scores = _scores(logits, temperature)
    (kept,) = _kept(scores, top_k, top_p, (0.0,), ties=False)
    probs = torch.softmax(scores.double().masked_fill(~kept, float("-inf")), dim=-1)
    return probs * (temperature > 0)[:, None]


def check_draw_distribution(
    fn: Callable[..., Any], args: tuple[Any, ...], significance: float = DISTRIBUTION_SIGNIFICANCE
) -> str | None:
    """The statistical contract: a G-test of ``fn``'s draws against the reference's probabilities; ``None`` if it fits.

    ``args`` repeats one row of logits and parameters under many seeds (:func:`distribution_samples`);
    a token top-k/top-p exclude fails at once, and the counts of the kept ones must fit
    ``softmax(logits / T)`` renormalised over them at ``significance``.
    """
    logits = args[0]
    draws, vocab = logits.shape
    got = fn(*args)
    problem = _output_problem(got, draws, vocab)
    if problem:
        return problem
    counts = torch.bincount(got.cpu(), minlength=vocab).double()
    probs = reference_probabilities(*(a[:1] for a in _on_host(args)[:4]))[0]
    kept = probs > 0
    if bool((counts * ~kept).any()):
        token = int((counts * ~kept).argmax())
        return f"drew token {token} {int(counts[token])} times in {draws} draws, which temperature/top-k/top-p exclude"
    observed, expected = counts[kept], draws * probs[kept]
    g = 2.0 * float(torch.where(observed > 0, observed * torch.log(observed / expected), 0.0).sum())
    freedom = int(kept.sum()) - 1
    if freedom == 0:
        return None
    p_value = float(
        torch.special.gammaincc(
            torch.tensor(freedom / 2, dtype=torch.float64), torch.tensor(g / 2, dtype=torch.float64)
        )
    )
    if p_value >= significance:
        return None
    worst = int(((observed - expected).abs() / expected.sqrt()).argmax())
    token = int(kept.nonzero()[worst])
    return (
        f"{draws} draws do not follow softmax(logits / T) over the {freedom + 1} tokens top-k/top-p keep: "
        f"G-test G = {g:.1f} with {freedom} degrees of freedom, p = {p_value:.2g} < {significance:g}; "
        f"token {token} was drawn {int(observed[worst])} times, {float(expected[worst]):.0f} expected"
    )


def _samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    """Every argument varied within one batch, rows enough that a wrong sampler cannot match by luck."""

    def case(label, vocab, temperature, top_k, top_p, scale=3.0, ties=False, offset=0.0):
        """Logits ``offset + scale * N(0, 1)`` in ``dtype`` with these per-row parameters and random seeds."""
        rows = len(temperature)
        logits = offset + scale * torch.randn(rows, vocab, generator=gen)
        if ties:  # whole numbers in [-9, 9]: several maxima in most rows
            logits = logits.round()
        return SampleInput(
            label,
            (
                logits.to(device, dtype),
                torch.tensor(temperature, dtype=torch.float32, device=device),
                None if top_k is None else torch.tensor(top_k, dtype=torch.int32, device=device),
                None if top_p is None else torch.tensor(top_p, dtype=torch.float32, device=device),
                torch.randint(-(2**63), 2**63 - 1, (rows,), generator=gen, dtype=torch.int64).to(device),
            ),
            large=vocab >= 32000,  # the vocabularies of real models: a fraction of a second, minutes interpreted
        )

    def pick(rows, choices):
        """``rows`` values drawn from ``choices`` (per-row parameters of a mixed batch)."""
        return [choices[i] for i in torch.randint(0, len(choices), (rows,), generator=gen).tolist()]

    def mixed(label, rows, vocab, truncating=True):
        temperature = pick(rows, [0.0, 0.3, 0.7, 1.0, 1.0, 1.5])
        if not truncating:
            return case(label, vocab, temperature, None, None)
        return case(
            label, vocab, temperature, pick(rows, [0, 0, 1, 5, 40, vocab]), pick(rows, [1.0, 1.0, 0.95, 0.8, 0.3, 1e-6])
        )

    return [
        case("greedy", 100, [0.0, 0.0, 0.0], [0, 5, 0], [1.0, 1.0, 0.5]),
        case("temperature", 100, [0.5, 1.0, 2.0], [0, 0, 0], [1.0, 1.0, 1.0]),
        case("greedy, ties at the maximum", 100, [0.0] * 16, [0, 1, 5, 0] * 4, [1.0, 1.0, 0.5, 1e-6] * 4, ties=True),
        case("temperature per row", 100, [0.05, 0.2, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0] * 4, [0] * 32, [1.0] * 32),
        case(
            "top-k per row",
            100,
            [1.0] * 32,
            [1, 2, 3, 4, 5, 8, 20, 99, 100, 1000, 0, 2, 3, 4, 6, 10] * 2,
            [1.0] * 32,
            scale=1.0,  # flat enough that the token after the k-th is often drawn when it is kept
        ),
        case("top-p per row", 100, [1.0, 0.7] * 16, [0] * 32, [1e-6, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0] * 4),
        # with top-p applied after top-k renormalises, p keeps far fewer than k here; the other order keeps k
        case(
            "top-k then top-p",
            1000,
            [0.7, 1.0, 1.5, 1.0] * 8,
            [5, 10, 20, 50] * 8,
            [0.3, 0.5, 0.7] * 10 + [0.5] * 2,
            scale=1.0,
        ),
        # LM-head logits (around 24) at low temperatures: scores of 60 to 160, where one divided in bf16
        # instead of float32 moves by up to 0.3, and the draw with it in about one row in ten
        case("large logits, low temperature", 1000, [0.15, 0.2, 0.3, 0.4] * 32, [0] * 128, [1.0] * 128, 0.3, offset=24),
        mixed("mixed batch", 64, 1000),
        mixed("256 rows", 256, 64),
        # what the engine passes for SamplingParams' defaults (top_k -1, top_p 1.0), greedy rows among sampled ones
        case(
            "engine defaults: top_k -1, top_p 1, greedy rows among sampled",
            100,
            [0.0, 0.7, 1.0, 0.0] * 4,
            [-1] * 16,
            [1.0] * 16,
        ),
        case("top_k -1 with top_p per row", 100, [1.0] * 8, [-1] * 8, [0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0, 0.6]),
        # None: the caller knows no row truncates by it (the engine's sampled steps with SamplingParams' defaults)
        case("top_k and top_p None, greedy rows among sampled", 100, [0.0, 0.7, 1.0, 1.5] * 4, None, None),
        case("top_k None, top_p per row", 100, [1.0, 0.7] * 4, None, [0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0, 0.6]),
        case("top_p None, top_k per row", 100, [1.0, 0.7] * 4, [1, 2, 5, 20, 99, 100, 0, -1], None, scale=1.0),
        mixed("mixed batch, nothing truncated", 64, 1000, truncating=False),
        case("llama2 vocabulary", 32000, [0.0, 0.7, 1.3], [0, 50, 1000], [1.0, 0.9, 0.95]),
        case("llama3-8b vocabulary", 128256, [0.0, 0.7], [0, 50], [1.0, 0.9]),
        case("llama3-8b vocabulary, nothing truncated", 128256, [0.0, 1.0, 0.6], None, None),
        case("qwen2 vocabulary", 151936, [0.8, 1.2], [20, 0], [0.95, 1.0]),
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
        ErrorInput("seeds None (only top_k and top_p may be None)", (logits, t, None, None, None), "seeds must be"),
    ]


def _value_errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    t, k, p = (
        torch.ones(2, device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
        torch.ones(2, device=device),
    )
    seeds = torch.zeros(2, dtype=torch.int64, device=device)
    nan_logits = logits.clone()
    nan_logits[1, 4] = float("nan")
    return [
        ErrorInput(
            "negative temperature", (logits, torch.tensor([1.0, -0.5], device=device), k, p, seeds), "temperature[1]"
        ),
        ErrorInput(
            "NaN temperature",
            (logits, torch.tensor([float("nan"), 1.0], device=device), k, p, seeds),
            "temperature[0] is nan",
        ),
        ErrorInput(
            "infinite temperature",
            (logits, torch.tensor([float("inf"), 1.0], device=device), k, p, seeds),
            "temperature[0] is inf",
        ),
        ErrorInput("top_p 0", (logits, t, k, torch.tensor([0.5, 0.0], device=device), seeds), "top_p[1] is 0"),
        ErrorInput("top_p above 1", (logits, t, k, torch.tensor([1.5, 1.0], device=device), seeds), "top_p[0] is 1.5"),
        ErrorInput("NaN logits", (nan_logits, t, k, p, seeds), "logits[1, 4] is NaN"),
    ]


sample = Op(
    name="sample",
    reference=sample_reference,
    tolerances={
        dtype: Tolerance(0.0, 0.0, "checked by the allowed-token oracle and the reference's draws, not by value")
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    },
    hand_samples=_samples,
    errors=_errors,
    value_errors=_value_errors,
    fake=lambda logits, *_args: logits.new_empty((logits.shape[0],), dtype=torch.int64),
    checker=_check_sampler,
    variants=Variants(
        base="256 rows",
        index={"top_k": (torch.int32, torch.int64), "seeds": (torch.int64,)},
        rows=("logits", "temperature", "top_k", "top_p", "seeds"),
    ),
)
