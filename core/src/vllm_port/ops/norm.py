"""Normalisation ops."""

from __future__ import annotations

import math

import torch

from ..errors import OpInputError
from ._checks import check_float, check_same
from ._op import ErrorInput, Op, SampleInput, Tolerance


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    check_float(op, "x", x)
    check_float(op, "weight", weight)
    check_same(op, "weight", weight, "x", x)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise OpInputError(
            f"{op}: weight has shape {tuple(weight.shape)} but x has shape {tuple(x.shape)}; "
            "weight must be 1-D with x's last dimension"
        )
    if not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon < 0:
        raise OpInputError(f"{op}: epsilon must be a finite float >= 0, got {epsilon!r}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """Refuse arguments outside ``rms_norm``'s contract."""
    _check_norm("rms_norm", x, weight, epsilon)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, as Llama defines it.

    The mean of squares is taken in float32 (float64 for float64 input), the normalised value is
    rounded to ``x``'s dtype, then scaled by ``weight``.
    """
    check_rms_norm(x, weight, epsilon)
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    variance = xc.pow(2).mean(dim=-1, keepdim=True)
    return (xc * torch.rsqrt(variance + epsilon)).to(x.dtype) * weight


def check_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """Refuse arguments outside ``fused_add_rms_norm``'s contract."""
    _check_norm("fused_add_rms_norm", x, weight, epsilon)
    check_float("fused_add_rms_norm", "residual", residual)
    check_same("fused_add_rms_norm", "residual", residual, "x", x)
    if residual.shape != x.shape:
        raise OpInputError(
            f"fused_add_rms_norm: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match"
        )


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> torch.Tensor:
    """Add ``x`` into ``residual`` in place (rounded to its dtype), then return ``rms_norm`` of the sum.

    This is a Llama decoder layer's ``residual = x + residual; h = norm(residual)`` in one pass.
    """
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    residual.add_(x)
    return rms_norm_reference(residual, weight, epsilon)


def _rms_norm_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label: str, tokens: int, hidden: int) -> SampleInput:
        x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
        return SampleInput(label, (x, w, 1e-6))

    # Mean of squares ~1e-6 against epsilon 1e-2: a provider that drops or fixes epsilon is off 100x.
    tiny = 1e-3 * torch.randn(3, 128, generator=gen)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(device, dtype)
    return [
        case("small", 7, 64),
        case("one token", 1, 256),
        case("llama3-8b decode", 4, 4096),
        case("llama3-8b prefill", 64, 4096),
        SampleInput("epsilon dominates", (tiny.to(device, dtype), weight, 1e-2)),
    ]


def _fused_add_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    return [
        SampleInput(s.label, (s.args[0], torch.randn(s.args[0].shape, generator=gen).to(device, dtype), *s.args[1:]))
        for s in _rms_norm_samples(dtype, device, gen)
    ]


def _rms_norm_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(2, 8, device=device)
    return [
        ErrorInput("weight of wrong length", (x, torch.ones(7, device=device), 1e-6), "weight has shape"),
        ErrorInput("integer input", (x.to(torch.int32), torch.ones(8, device=device), 1e-6), "x has dtype"),
        ErrorInput(
            "mixed dtypes", (x, torch.ones(8, device=device, dtype=torch.float16), 1e-6), "cast them to one dtype"
        ),
        ErrorInput("negative epsilon", (x, torch.ones(8, device=device), -1.0), "epsilon"),
    ]


def _fused_add_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(2, 8, device=device)
    return [
        ErrorInput(
            "residual of another shape",
            (x, torch.randn(3, 8, device=device), torch.ones(8, device=device), 1e-6),
            "residual has shape",
        ),
        ErrorInput(
            "residual of another dtype", (x, x.half(), torch.ones(8, device=device), 1e-6), "cast them to one dtype"
        ),
        ErrorInput("weight of wrong length", (x, x.clone(), torch.ones(7, device=device), 1e-6), "weight has shape"),
    ]


_NORM_TOLERANCES = {
    torch.float32: Tolerance(1e-5, 1e-5, "float32 reductions in another order differ by a few ulps"),
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bfloat16 keeps 8 significant bits: two roundings of 2^-8 each"),
    torch.float16: Tolerance(1e-3, 2e-3, "float16 keeps 11 significant bits: two roundings of 2^-11 each"),
}

rms_norm = Op(
    name="rms_norm",
    reference=rms_norm_reference,
    tolerances=_NORM_TOLERANCES,
    samples=_rms_norm_samples,
    errors=_rms_norm_errors,
    fake=lambda x, weight, epsilon: torch.empty_like(x),
)

fused_add_rms_norm = Op(
    name="fused_add_rms_norm",
    reference=fused_add_rms_norm_reference,
    tolerances=_NORM_TOLERANCES,
    samples=_fused_add_samples,
    errors=_fused_add_errors,
    mutates=("residual",),
    fake=lambda x, residual, weight, epsilon: torch.empty_like(x),
)
