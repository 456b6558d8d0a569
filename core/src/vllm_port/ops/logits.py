"""Logits processing and log-probabilities: what vLLM's sampler does to the logits besides drawing.

Two contract ops, each run per step only when some request of the step asks for what it does (a
step without such a request costs what it cost before they existed):

- :data:`process_logits`: a request's ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
  ``min_tokens`` (as one additive bias, ``-inf`` banning a token), then vLLM's penalties
  (repetition over the prompt and the output, frequency and presence over the output), then
  ``min_p`` (which needs the temperature the ``sample`` op divides by next). It returns float32
  logits the ``sample`` op draws from; greedy rows take its argmax.
- :data:`top_logprobs`: the log-probabilities of the model's raw logits (``log_softmax`` in
  float32, vLLM's default ``raw_logprobs``): each row's given token's logprob and rank, and the
  ``num_top`` largest logprobs with their token ids.

How conformance judges a provider: values within the tolerance table's float32 rounding of the
float64 reference; a ban (``-inf``) exactly where the reference bans, except a token whose
probability ratio to the top token lies within :data:`MIN_P_SLACK` of ``min_p`` (either answer is
right there); for ``top_logprobs``, a rank and a top-N set that the reference's logprobs allow up to
the tolerance (tokens whose logprobs tie within it may come in either order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import OpInputError
from ._checks import INDEX_DTYPES, check_float, check_int, first_bad, reads_values
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants

__all__ = [
    "LOGPROB_TOLERANCE",
    "MIN_P_SLACK",
    "PROCESS_TOLERANCE",
    "check_process_logits",
    "check_top_logprobs",
    "process_logits",
    "process_logits_reference",
    "top_logprobs",
    "top_logprobs_reference",
]

#: float32 processing of logits that are exact in float32: a division by the repetition penalty and
#: a subtraction or two round once or twice (2^-23 relative each); 1e-5 leaves room, a penalty off
#: by 1% (or applied twice) is a thousand times outside.
PROCESS_TOLERANCE = Tolerance(1e-5, 1e-5, "float32 processing of float32-exact logits: one or two roundings")
#: A log-softmax in float32 over 152k logits: the log of a sum of exponentials in another order
#: errs by a few 1e-6 at logprobs of -30; 1e-4 absolute leaves room, one computed in bfloat16 (2^-9
#: relative on the logits) is far outside.
LOGPROB_TOLERANCE = Tolerance(1e-4, 1e-5, "float32 log-softmax over up to 152k logits, summed in any order")
#: Relative band around ``min_p`` in which a token's probability ratio to the top token may be
#: judged either way (a softmax in float32 against exp of a difference: a few ulps).
MIN_P_SLACK = 1e-4

_ROW_ARGS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "temperature", "min_p")


# ------------------------------------------------------------------------------------------------
# process_logits
# ------------------------------------------------------------------------------------------------


def _check_device(op: str, arg: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise OpInputError(f"{op}: {arg} is on {t.device} but logits is on {device}; move them to one device")


def check_process_logits(
    logits,
    bias,
    output_counts,
    prompt_mask,
    repetition_penalty,
    frequency_penalty,
    presence_penalty,
    temperature,
    min_p,
) -> None:
    """Refuse arguments outside ``process_logits``'s contract; values are checked under validation."""
    op = "process_logits"
    check_float(op, "logits", logits)
    shape, device = logits.shape, logits.device
    if len(shape) != 2 or shape[1] < 1:
        raise OpInputError(f"{op}: logits has shape {tuple(shape)}; it must be [num_seqs, vocab_size >= 1]")
    rows = shape[0]
    # one loop over plain tuples: this runs on every call (a provider's host time, issue 30)
    for arg, t, dtype in (("bias", bias, torch.float32), ("output_counts", output_counts, torch.int32),
                          ("prompt_mask", prompt_mask, torch.bool)):  # fmt: skip
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != shape:
            raise OpInputError(
                f"{op}: {arg} must be a tensor of dtype {str(dtype).removeprefix('torch.')} and logits' shape "
                f"{list(shape)} (one entry per sequence and token)"
            )
        _check_device(op, arg, t, device)
    per_row = (repetition_penalty, frequency_penalty, presence_penalty, temperature, min_p)
    for arg, t in zip(_ROW_ARGS, per_row, strict=True):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (rows,):
            raise OpInputError(f"{op}: {arg} must be a float32 tensor of shape [{rows}] (one value per sequence)")
        _check_device(op, arg, t, device)
    if reads_values(logits, bias, output_counts, repetition_penalty):
        _check_process_values(logits, bias, output_counts, repetition_penalty, frequency_penalty, presence_penalty,
                              temperature, min_p)  # fmt: skip


def _check_process_values(logits, bias, counts, repetition, frequency, presence, temperature, min_p) -> None:
    op = "process_logits"
    for arg, t, bad, rule in (
        ("repetition_penalty", repetition, ~(repetition.isfinite() & (repetition > 0)), "finite and > 0 (1: none)"),
        ("frequency_penalty", frequency, ~frequency.isfinite(), "finite (0: none)"),
        ("presence_penalty", presence, ~presence.isfinite(), "finite (0: none)"),
        ("temperature", temperature, ~(temperature.isfinite() & (temperature >= 0)), "finite and >= 0 (0: greedy)"),
        ("min_p", min_p, ~((min_p >= 0) & (min_p <= 1)), "in [0, 1] (0: none)"),
    ):
        at = first_bad(bad)
        if at is not None:
            raise OpInputError(f"{op}: {arg}[{at[0]}] is {float(t[at]):g}; it must be {rule}")
    at = first_bad(bias.isnan() | (bias == float("inf")))
    if at is not None:
        raise OpInputError(
            f"{op}: bias[{at[0]}, {at[1]}] is {float(bias[at])}; a bias is finite, or -inf to ban the token"
        )
    at = first_bad(counts < 0)
    if at is not None:
        raise OpInputError(f"{op}: output_counts[{at[0]}, {at[1]}] is {int(counts[at])}; a count is >= 0")
    at = first_bad(logits.isnan())
    if at is not None:
        raise OpInputError(f"{op}: logits[{at[0]}, {at[1]}] is NaN; no token can be drawn from it")


def process_logits_reference(
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
    """The logits ``sample`` draws from, float32 ``[num_seqs, vocab_size]`` (float64 for float64 input).

    Per sequence, in vLLM's order:

    1. ``x = logits + bias`` (a bias of ``-inf`` bans the token: logit_bias, allowed_token_ids,
       bad_words and min_tokens all arrive here as one bias);
    2. repetition penalty ``r`` on every token seen in the prompt (``prompt_mask``) or the output
       (``output_counts > 0``): ``x / r`` where ``x > 0``, ``x * r`` elsewhere;
    3. ``x -= frequency_penalty * output_counts + presence_penalty * (output_counts > 0)``;
    4. ``min_p`` (only where ``temperature > 0`` and ``min_p > 0``): a token whose probability under
       ``softmax(x / temperature)`` is below ``min_p`` times the most likely token's becomes ``-inf``.
    """
    check_process_logits(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty,
                         presence_penalty, temperature, min_p)  # fmt: skip
    return _process(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty, presence_penalty,
                    temperature, min_p)  # fmt: skip


def _process(logits, bias, output_counts, prompt_mask, repetition_penalty, frequency_penalty, presence_penalty,
             temperature, min_p) -> torch.Tensor:  # fmt: skip
    """:func:`process_logits_reference` without the checks (the checker runs it in float64)."""
    compute = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(compute) + bias.to(compute)
    seen = prompt_mask | (output_counts > 0)
    r = repetition_penalty.to(compute)[:, None]
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    counts = output_counts.to(compute)
    x = x - frequency_penalty.to(compute)[:, None] * counts - presence_penalty.to(compute)[:, None] * (counts > 0)
    use_min_p = (temperature > 0) & (min_p > 0)
    scores = x / torch.where(use_min_p, temperature, 1.0).to(compute)[:, None]
    probs = torch.softmax(scores, dim=-1)
    below = probs < min_p.to(compute)[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(below & use_min_p[:, None], float("-inf")).contiguous()


def _check_processed(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """Values within the tolerance, bans where the reference bans (up to :data:`MIN_P_SLACK` at ``min_p``'s edge)."""
    host = tuple(a.detach().cpu().clone() for a in args)
    got = fn(*args)
    logits = args[0]
    if not isinstance(got, torch.Tensor) or got.shape != logits.shape or got.dtype != torch.float32:
        what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return f"output: returned {what}; the op returns float32 of logits' shape {tuple(logits.shape)}"
    if not got.is_contiguous():
        return f"output: has strides {got.stride()}; the contract returns contiguous tensors"
    wide = tuple(a.double() if a.is_floating_point() else a for a in host)
    want = _process(*wide)
    unmasked = _process(*wide[:7], wide[7], torch.zeros_like(wide[8]))
    got = got.detach().cpu().double()
    # where min_p may go either way: the token's probability ratio to the top one within the slack of min_p
    temperature, min_p = wide[7], wide[8]
    scores = unmasked / torch.where(temperature > 0, temperature, 1.0)[:, None]
    ratio = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    edge = ((ratio / min_p.clamp(min=1e-30)[:, None] - 1).abs() < MIN_P_SLACK) & (min_p > 0)[:, None]
    ban_got, ban_want = got == float("-inf"), want == float("-inf")
    wrong_ban = (ban_got != ban_want) & ~edge
    if bool(wrong_ban.any()):
        r, t = (int(i) for i in wrong_ban.nonzero()[0])
        return (
            f"output: {int(wrong_ban.sum())} tokens banned (-inf) or kept unlike the reference; first at ({r}, {t}): "
            f"got {float(got[r, t]):.6g}, expected {float(want[r, t]):.6g} (bias {float(host[1][r, t]):g}, "
            f"min_p {float(min_p[r]):g}, temperature {float(temperature[r]):g})"
        )
    both = ~ban_got & ~ban_want
    tol = PROCESS_TOLERANCE
    bad = both & ~torch.isclose(got, unmasked, rtol=tol.rtol, atol=tol.atol)
    if bool(bad.any()):
        r, t = (int(i) for i in bad.nonzero()[0])
        return (
            f"output: {int(bad.sum())} of {bad.numel()} values off (atol={tol.atol}, rtol={tol.rtol}); first at "
            f"({r}, {t}): got {float(got[r, t]):.7g}, expected {float(unmasked[r, t]):.7g} (logit "
            f"{float(host[0][r, t]):.6g}, bias {float(host[1][r, t]):g}, count {int(host[2][r, t])}, in prompt "
            f"{bool(host[3][r, t])}, repetition {float(host[4][r]):g}, frequency {float(host[5][r]):g}, presence "
            f"{float(host[6][r]):g})"
        )
    return _unchanged_inputs(args, host)


def _unchanged_inputs(args: tuple[Any, ...], before: tuple[Any, ...]) -> str | None:
    """Nothing the op only reads was written (``before``: copies made before the call)."""
    for i, (a, b) in enumerate(zip(args, before, strict=True)):
        if isinstance(a, torch.Tensor) and not torch.equal(a.detach().cpu().nan_to_num(0.0), b.nan_to_num(0.0)):
            return f"argument {i} was modified, but the op only reads it"
    return None


def _process_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    """Each processor alone, then all of them mixed per row, at small and real vocabularies."""

    def case(label, vocab, repetition, frequency, presence, temperature, min_p, *, bans=0.0, bias=0.0, seen=0.2,
             scale=3.0):  # fmt: skip
        rows = len(repetition)
        logits = scale * torch.randn(rows, vocab, generator=gen)
        b = bias * torch.randn(rows, vocab, generator=gen).clamp(-3, 3)  # finite biases of either sign
        if bans:
            b = b.masked_fill(torch.rand(rows, vocab, generator=gen) < bans, float("-inf"))
        counts = torch.where(
            torch.rand(rows, vocab, generator=gen) < seen, torch.randint(1, 5, (rows, vocab), generator=gen), 0
        ).to(torch.int32)
        prompt = torch.rand(rows, vocab, generator=gen) < seen
        per_row = [torch.tensor(v, dtype=torch.float32) for v in (repetition, frequency, presence, temperature, min_p)]
        return SampleInput(
            label,
            (logits.to(device, dtype), b.to(device), counts.to(device), prompt.to(device), *(v.to(device) for v in per_row)),
            large=vocab >= 32000,
        )  # fmt: skip

    def mixed(label, rows, vocab):
        def pick(choices):
            return [choices[i] for i in torch.randint(0, len(choices), (rows,), generator=gen).tolist()]

        return case(
            label,
            vocab,
            pick([1.0, 1.0, 1.1, 1.5, 0.8]),
            pick([0.0, 0.0, 0.5, -0.5, 2.0]),
            pick([0.0, 0.0, 0.3, -1.0, 2.0]),
            pick([0.0, 0.7, 1.0, 1.3]),
            pick([0.0, 0.0, 0.05, 0.2]),
            bans=0.01,
            bias=1.0,
        )

    none = [1.0, 1.0, 1.0, 1.0]
    zeros = [0.0, 0.0, 0.0, 0.0]
    return [
        case("no processing", 100, none, zeros, zeros, [1.0] * 4, zeros),
        case("bias and bans", 100, none, zeros, zeros, [1.0] * 4, zeros, bans=0.1, bias=5.0),
        case("repetition penalty per row", 100, [1.2, 2.0, 0.5, 1.0], zeros, zeros, [1.0] * 4, zeros, seen=0.4),
        case("frequency penalty per row", 100, none, [0.5, -0.5, 2.0, -2.0], zeros, [1.0] * 4, zeros, seen=0.4),
        case("presence penalty per row", 100, none, zeros, [0.5, -0.5, 2.0, -2.0], [1.0] * 4, zeros, seen=0.4),
        case("min_p per row", 100, none, zeros, zeros, [1.0, 0.5, 1.5, 0.0], [0.1, 0.05, 0.3, 0.5], scale=1.5),
        case("min_p 1 keeps the maxima", 100, none, zeros, zeros, [1.0] * 4, [1.0] * 4),
        case(
            "every processor at once",
            1000,
            [1.3, 0.9, 1.1, 1.0],
            [0.4, 0.0, -0.3, 1.0],
            [0.2, 1.0, 0.0, -0.4],
            [0.8, 1.0, 0.0, 1.2],
            [0.05, 0.0, 0.3, 0.1],
            bans=0.02,
            bias=2.0,
        ),
        # the variants' base: every argument read, and biases finite (row variants draw fresh ones like them)
        case(
            "every processor, finite biases",
            100,
            [1.3, 0.9, 1.1, 1.0],
            [0.4, 0.0, -0.3, 1.0],
            [0.2, 1.0, 0.0, -0.4],
            [0.8, 1.0, 0.0, 1.2],
            [0.05, 0.0, 0.3, 0.1],
            bias=2.0,
        ),
        mixed("mixed batch", 64, 1000),
        _as_column_slice(mixed("logits a slice of a wider buffer", 8, 100)),
        mixed("256 rows", 256, 64),
        mixed("llama2 vocabulary", 3, 32000),
        mixed("llama3-8b vocabulary", 2, 128256),
        mixed("qwen2 vocabulary", 2, 151936),
    ]


def _as_column_slice(sample: SampleInput) -> SampleInput:
    """``sample`` with its logits the first columns of a wider buffer (rows strided, as a fused LM head's output)."""
    logits = sample.args[0]
    wide = torch.full((logits.shape[0], logits.shape[1] + 24), float("nan"), dtype=logits.dtype, device=logits.device)
    wide[:, : logits.shape[1]] = logits
    return SampleInput(sample.label, (wide[:, : logits.shape[1]], *sample.args[1:]), sample.large)


def _process_errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    bias = torch.zeros(2, 10, device=device)
    counts = torch.zeros(2, 10, dtype=torch.int32, device=device)
    mask = torch.zeros(2, 10, dtype=torch.bool, device=device)
    one = torch.ones(2, device=device)
    zero = torch.zeros(2, device=device)
    good = (logits, bias, counts, mask, one, zero, zero, one, zero)

    def but(i, value):
        return tuple(value if j == i else a for j, a in enumerate(good))

    return [
        ErrorInput("1-D logits", but(0, logits[0]), "[num_seqs, vocab_size"),
        ErrorInput("bias of one row", but(1, bias[:1]), "bias must be a tensor of dtype float32"),
        ErrorInput("int64 counts", but(2, counts.long()), "output_counts must be a tensor of dtype int32"),
        ErrorInput("float prompt mask", but(3, bias), "prompt_mask must be a tensor of dtype bool"),
        ErrorInput("repetition per batch", but(4, one[:1]), "repetition_penalty must be a float32 tensor"),
        ErrorInput("float64 min_p", but(8, zero.double()), "min_p must be a float32 tensor"),
    ]


def _process_value_errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    bias = torch.zeros(2, 10, device=device)
    counts = torch.zeros(2, 10, dtype=torch.int32, device=device)
    mask = torch.zeros(2, 10, dtype=torch.bool, device=device)
    one, zero = torch.ones(2, device=device), torch.zeros(2, device=device)

    def with_(i, value):
        args = [logits, bias, counts, mask, one, zero, zero, one, zero]
        args[i] = value
        return tuple(args)

    nan_bias = bias.clone()
    nan_bias[1, 3] = float("nan")
    negative = counts.clone()
    negative[0, 2] = -1
    return [
        ErrorInput("repetition 0", with_(4, torch.tensor([1.0, 0.0], device=device)), "repetition_penalty[1] is 0"),
        ErrorInput("min_p above 1", with_(8, torch.tensor([1.5, 0.0], device=device)), "min_p[0] is 1.5"),
        ErrorInput("NaN bias", with_(1, nan_bias), "bias[1, 3] is nan"),
        ErrorInput("negative count", with_(2, negative), "output_counts[0, 2] is -1"),
        ErrorInput("infinite frequency", with_(5, torch.tensor([0.0, float("inf")], device=device)), "frequency_penalty[1]"),
    ]  # fmt: skip


process_logits = Op(
    name="process_logits",
    reference=process_logits_reference,
    tolerances={dtype: PROCESS_TOLERANCE for dtype in (torch.float32, torch.bfloat16, torch.float16)},
    hand_samples=_process_samples,
    errors=_process_errors,
    value_errors=_process_value_errors,
    fake=lambda logits, *_args: logits.new_empty(logits.shape, dtype=torch.float32),
    checker=_check_processed,
    variants=Variants(
        base="every processor, finite biases", rows=("logits", "bias", "output_counts", "prompt_mask", *_ROW_ARGS)
    ),
)


# ------------------------------------------------------------------------------------------------
# top_logprobs
# ------------------------------------------------------------------------------------------------


def check_top_logprobs(logits, token_ids, num_top) -> None:
    """Refuse arguments outside ``top_logprobs``'s contract; token ids are checked under validation."""
    op = "top_logprobs"
    check_float(op, "logits", logits)
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise OpInputError(f"{op}: logits has shape {tuple(logits.shape)}; it must be [num_seqs, vocab_size >= 1]")
    rows, vocab = logits.shape
    if not isinstance(token_ids, torch.Tensor) or token_ids.dtype not in INDEX_DTYPES or token_ids.shape != (rows,):
        raise OpInputError(f"{op}: token_ids must be an int32 or int64 tensor of shape [{rows}] (one id per sequence)")
    if token_ids.device != logits.device:
        raise OpInputError(
            f"{op}: token_ids is on {token_ids.device} but logits is on {logits.device}; move them to one device"
        )
    check_int(op, "num_top", num_top, 0, "how many of the largest logprobs to return")
    if num_top > vocab:
        raise OpInputError(f"{op}: num_top is {num_top}, more than the vocabulary's {vocab} tokens")
    if reads_values(logits, token_ids):
        at = first_bad((token_ids < 0) | (token_ids >= vocab))
        if at is not None:
            raise OpInputError(f"{op}: token_ids[{at[0]}] is {int(token_ids[at])}, outside [0, {vocab})")
        at = first_bad(logits.isnan())
        if at is not None:
            raise OpInputError(f"{op}: logits[{at[0]}, {at[1]}] is NaN; no logprob can be computed from it")


def top_logprobs_reference(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)``, float32 and int64 ``[num_seqs, 1 + num_top]``, of ``log_softmax(logits)`` per row.

    Column 0: ``token_ids``' logprob in ``values`` and its rank in ``indices`` (1 + the number of
    tokens with a strictly larger logprob). Columns 1 to ``num_top``: the ``num_top`` largest
    logprobs in descending order and their token ids (ties: lowest id first). The logprobs are
    computed in float32 (float64 for float64 logits) from the logits as given.
    """
    check_top_logprobs(logits, token_ids, num_top)
    compute = torch.promote_types(logits.dtype, torch.float32)
    lp = torch.log_softmax(logits.to(compute), dim=-1)
    ids = token_ids.long()
    own = lp.gather(1, ids[:, None])
    rank = (lp > own).sum(dim=-1, keepdim=True) + 1
    top, order = lp.sort(dim=-1, descending=True, stable=True)
    return torch.cat((own, top[:, :num_top]), dim=1), torch.cat((rank, order[:, :num_top]), dim=1)


def _check_logprobs(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """Values within the tolerance of float64; the rank and the top set what those values allow."""
    logits, token_ids, num_top = args
    got = fn(*args)
    rows = logits.shape[0]
    shape = (rows, 1 + num_top)
    if (
        not isinstance(got, tuple)
        or len(got) != 2
        or not all(isinstance(t, torch.Tensor) and t.shape == shape for t in got)
        or got[0].dtype != torch.float32
        or got[1].dtype != torch.int64
    ):
        return f"output: the op returns (float32, int64) tensors of shape {list(shape)}; got {_describe(got)}"
    if not all(t.is_contiguous() for t in got):
        return "output: the contract returns contiguous tensors"
    tol = LOGPROB_TOLERANCE
    values, indices = (t.detach().cpu() for t in got)
    want = torch.log_softmax(logits.detach().cpu().double(), dim=-1)
    ids = token_ids.detach().cpu().long()
    slack = tol.atol + tol.rtol * want.abs()
    own = want.gather(1, ids[:, None])[:, 0]
    own_slack = slack.gather(1, ids[:, None])[:, 0]
    far = ~torch.isclose(values[:, 0].double(), own, rtol=tol.rtol, atol=tol.atol)
    if bool(far.any()):
        r = int(far.nonzero()[0])
        return f"row {r}: token {int(ids[r])}'s logprob is {float(values[r, 0]):.7g}, expected {float(own[r]):.7g}"
    low = (want > (own + own_slack)[:, None]).sum(-1) + 1
    high = (want >= (own - own_slack)[:, None]).sum(-1)
    rank = indices[:, 0]
    off = (rank < low) | (rank > high)
    if bool(off.any()):
        r = int(off.nonzero()[0])
        return f"row {r}: token {int(ids[r])}'s rank is {int(rank[r])}; its logprob allows ranks {int(low[r])} to {int(high[r])}"
    if num_top == 0:
        return None
    top_ids = indices[:, 1:]
    if bool(((top_ids < 0) | (top_ids >= logits.shape[1])).any()):
        return f"top ids outside the vocabulary [0, {logits.shape[1]}): {top_ids.tolist()[:2]}"
    if bool((top_ids.sort(dim=-1).values.diff(dim=-1) == 0).any()):
        return "a row's top ids repeat a token"
    exact = want.gather(1, top_ids)
    far = ~torch.isclose(values[:, 1:].double(), exact, rtol=tol.rtol, atol=tol.atol)
    if bool(far.any()):
        r, c = (int(i) for i in far.nonzero()[0])
        return f"row {r}: top logprob {c + 1} (token {int(top_ids[r, c])}) is {float(values[r, c + 1]):.7g}, expected {float(exact[r, c]):.7g}"
    kth = want.topk(num_top, dim=-1).values[:, -1:]
    short = exact < kth - slack.gather(1, top_ids)
    if bool(short.any()):
        r, c = (int(i) for i in short.nonzero()[0])
        return (
            f"row {r}: token {int(top_ids[r, c])} (logprob {float(exact[r, c]):.7g}) is not among the {num_top} largest "
            f"(the {num_top}th is {float(kth[r, 0]):.7g})"
        )
    if bool((values[:, 2:].double() > values[:, 1:-1].double() + tol.atol).any()):
        return "the top logprobs are not in descending order"
    return None


def _describe(got: Any) -> str:
    if isinstance(got, tuple):
        return "(" + ", ".join(_describe(t) for t in got) + ")"
    if isinstance(got, torch.Tensor):
        return f"{str(got.dtype).removeprefix('torch.')} {list(got.shape)}"
    return type(got).__name__


def _logprob_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, rows, vocab, num_top, *, scale=3.0, ties=False, offset=0.0):
        logits = offset + scale * torch.randn(rows, vocab, generator=gen)
        if ties:
            logits = logits.round()
        ids = torch.randint(0, vocab, (rows,), generator=gen)
        greedy = torch.rand(rows, generator=gen) < 0.5  # half the rows ask about their most likely token
        ids = torch.where(greedy, logits.to(dtype).float().argmax(dim=-1), ids)
        return SampleInput(label, (logits.to(device, dtype), ids.to(device), num_top), large=vocab >= 32000)

    return [
        case("sampled token only", 4, 100, 0),
        case("top 1", 4, 100, 1),
        case("top 5", 8, 100, 5),
        case("ties", 16, 100, 5, ties=True),
        case("large logits", 8, 1000, 20, scale=0.3, offset=24.0),
        case("every token", 2, 20, 20),
        case("64 rows", 64, 1000, 5),
        _as_column_slice(case("logits a slice of a wider buffer", 8, 100, 3)),
        case("256 rows", 256, 64, 3),
        case("llama2 vocabulary", 3, 32000, 5),
        case("llama3-8b vocabulary", 2, 128256, 20),
        case("qwen2 vocabulary", 2, 151936, 1),
    ]


def _logprob_errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    ids = torch.zeros(2, dtype=torch.int64, device=device)
    return [
        ErrorInput("1-D logits", (logits[0], ids, 1), "[num_seqs, vocab_size"),
        ErrorInput("one id for two rows", (logits, ids[:1], 1), "token_ids must be"),
        ErrorInput("float ids", (logits, ids.float(), 1), "token_ids must be"),
        ErrorInput("negative num_top", (logits, ids, -1), "num_top must be an int >= 0"),
        ErrorInput("num_top past the vocabulary", (logits, ids, 11), "num_top is 11"),
    ]


def _logprob_value_errors(device: torch.device) -> list[ErrorInput]:
    logits = torch.randn(2, 10, device=device)
    return [
        ErrorInput("id past the vocabulary", (logits, torch.tensor([0, 10], device=device), 1), "token_ids[1] is 10"),
        ErrorInput("negative id", (logits, torch.tensor([-1, 0], device=device), 1), "token_ids[0] is -1"),
    ]


def _fake_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (logits.shape[0], 1 + num_top)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int64)


top_logprobs = Op(
    name="top_logprobs",
    reference=top_logprobs_reference,
    tolerances={dtype: LOGPROB_TOLERANCE for dtype in (torch.float32, torch.bfloat16, torch.float16)},
    hand_samples=_logprob_samples,
    errors=_logprob_errors,
    value_errors=_logprob_value_errors,
    fake=_fake_logprobs,
    checker=_check_logprobs,
    variants=Variants(base="64 rows", index={"token_ids": (torch.int32, torch.int64)}, rows=("logits", "token_ids")),
)
