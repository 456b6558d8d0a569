"""One call of a provider against its op: the output's metadata against the fake, the values against the reference.

:func:`metadata_problem` costs O(1) in the data (the fake's answer is cached per input shapes);
:func:`compare_with_reference` runs the reference on the same inputs, in the call's dtype first and
in float64 where they disagree, as conformance does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._op import Op

if TYPE_CHECKING:
    from ._provider import Provider

__all__ = ["compare_with_reference", "metadata_problem"]

_UNKNOWN = object()  # the fake cannot say (it raised, or answered something else than a tensor or None)
_MISSING = object()


def metadata_problem(op: Op, args: tuple[Any, ...], out: Any, cache: dict[Any, Any] | None = None) -> str | None:
    """``out``'s shape, dtype and device against ``op``'s fake for ``args``; O(1) in the data.

    :param cache: input shapes -> the fake's answer, kept between calls (a microsecond per call when it hits).
    """
    if op.fake is None:
        return None
    try:
        key: Any = tuple([(a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args])
        expected = _MISSING if cache is None else cache.get(key, _MISSING)
    except TypeError:  # an unhashable argument: no caching
        key, expected = None, _MISSING
    if expected is _MISSING:
        expected = _fake_output(op, args)
        if cache is not None and key is not None and len(cache) < 4096:
            cache[key] = expected
    if expected is _UNKNOWN:
        return None
    if expected is None:
        return None if out is None else f"returned {type(out).__name__}; the op writes in place and returns None"
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    shape, dtype = expected
    if out.shape != shape:
        return f"returned shape {tuple(out.shape)}, expected {tuple(shape)}"
    if out.dtype != dtype:
        return f"returned dtype {out.dtype}, expected {dtype}"
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None  # every op's first argument, so far
    device = (
        first.device if first is not None else next((a.device for a in args if isinstance(a, torch.Tensor)), out.device)
    )
    if out.device != device:
        return f"returned a tensor on {out.device}, but the inputs are on {device}"
    return None


def _fake_output(op: Op, args: tuple[Any, ...]) -> Any:
    """``(shape, dtype)`` of ``op``'s output for ``args``' metadata, ``None`` for an in-place op, or ``_UNKNOWN``."""
    try:
        metas = tuple(
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
            for a in args
        )
        out = op.fake(*metas)  # type: ignore[misc]
    except Exception:
        return _UNKNOWN
    if out is None:
        return None
    return (out.shape, out.dtype) if isinstance(out, torch.Tensor) else _UNKNOWN


def _upcast_copy(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64, copy=True)
    return t.clone() if isinstance(t, torch.Tensor) else t


def _upcast(t: Any) -> Any:
    return t.detach().to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def compare_with_reference(
    op: Op, chosen: Provider, args: tuple[Any, ...], before: Mapping[int, torch.Tensor], out: Any, dtype: torch.dtype
) -> str | None:
    """What ``chosen`` got wrong in one call, against the reference on the same inputs; ``None`` if nothing.

    :param args: the call's arguments, in-place ones as ``chosen`` left them.
    :param before: copies of the in-place arguments from before the call.
    :param out: what ``chosen`` returned.

    First the reference runs in ``dtype`` (as cheap as the provider: no float64 copy of the weights
    or the KV cache), and a provider within the op's tolerance of it passes. Otherwise the float64
    reference decides, as conformance does: an element is wrong when it is outside the tolerance of
    the float64 reference *and* the reference in ``dtype`` lands inside it (where even the
    reference in ``dtype`` cannot meet the tolerance on these inputs, the tolerance does not fit
    them, and the provider is not blamed). So a provider off by less than twice the tolerance may
    pass a sampled call; gross faults (wrong values, NaN) never do.
    """
    if op.name == "sample":
        return _compare_draws(op, chosen, args, out)
    if op.checker is not None:
        return None  # an op whose outputs are not values: only its metadata is checked
    tol = op.tolerances.get(dtype)
    if tol is None:
        return None
    inputs = tuple(before.get(i, a) for i, a in enumerate(args))
    mutated = sorted(before)
    base_args = tuple(a.clone() if i in before else a for i, a in enumerate(inputs))
    base_out = op.reference(*base_args)
    names = list(op.signature.parameters)
    pairs = [("output", out, base_out, None)] if base_out is not None else []
    pairs += [(f"{names[i]} (written in place)", args[i], base_args[i], i) for i in mutated]
    suspects = [pair for pair in pairs if not _close(pair[1], pair[2], tol)]
    if not suspects:
        return None
    ref_args = tuple(_upcast_copy(a) if i in before else _upcast(a) for i, a in enumerate(inputs))
    expected = op.reference(*ref_args)
    problems = []
    for where, got, base, index in suspects:
        want = expected if index is None else ref_args[index]
        found = _disagreement(got, want, tol, base)
        if found:
            problems.append(f"{where}: {found}")
    return "; ".join(problems) or None


def _close(got: Any, base: Any, tol: Any) -> bool:
    """Whether ``got`` is within the tolerance of the reference run in the input dtype (on the device)."""
    if not isinstance(got, torch.Tensor) or not isinstance(base, torch.Tensor) or got.shape != base.shape:
        return False
    if not got.is_floating_point():
        return bool(torch.equal(got, base))
    return bool(torch.isclose(got.float(), base.float(), rtol=tol.rtol, atol=tol.atol, equal_nan=True).all())


def _disagreement(got: Any, want: torch.Tensor, tol: Any, baseline: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"is {type(got).__name__}, not a tensor"
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(g, w, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    if not bool(bad.any()):
        return None
    b = baseline.detach().to("cpu", torch.float64)
    bad &= torch.isclose(b, w, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    if not bool(bad.any()):
        return None
    error = (g - w).abs()[bad]
    worst = float(error.nan_to_num(math.inf).max())  # NaN where a number belongs counts as an infinite error
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} elements off the reference beyond the tolerance (atol={tol.atol}, "
        f"rtol={tol.rtol}); max abs error {worst:.3g}; first at {index}: got {g[index].item():.6g}, "
        f"expected {w[index].item():.6g}"
    )


def _compare_draws(op: Op, chosen: Provider, args: tuple[Any, ...], out: Any) -> str | None:
    from .sampling import acceptable_draws, allowed_tokens

    host = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    tokens = out.cpu()
    vocab = host[0].shape[1]
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        return f"drew ids outside the vocabulary [0, {vocab}): {tokens.tolist()[:16]}"
    if chosen.equivalence == "statistical":
        ok = allowed_tokens(*host[:4]).gather(1, tokens[:, None])[:, 0]
        rule = "tokens temperature/top-k/top-p allow"
    else:
        ok = acceptable_draws(*host).gather(1, tokens[:, None])[:, 0]
        rule = "the reference's draws from the same seeds"
    if bool(ok.all()):
        return None
    row = int((~ok).nonzero()[0])
    want = int(op.reference(*host)[row])
    return (
        f"drew token {int(tokens[row])} in row {row}, where the reference draws {want} "
        f"({int((~ok).sum())} of {len(tokens)} rows differ from {rule})"
    )
