"""Normalisation ops."""

from __future__ import annotations

import math

import torch

from ..errors import OpInputError
from ._checks import check_float, check_same, check_writable
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants


def _check_norm(op: str, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    check_float(op, "x", x)
    check_float(op, "weight", weight)
    check_same(op, "weight", weight, "x", x)
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise OpInputError(
            f"{op}: weight has shape {tuple(weight.shape)} but x has shape {tuple(x.shape)}; "
            "weight must be 1-D with x's last dimension"
        )
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not math.isfinite(epsilon) or epsilon < 0:
        raise OpInputError(f"{op}: epsilon must be a finite float >= 0, got {epsilon!r}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """Refuse arguments outside ``rms_norm``'s contract."""
    _check_norm("rms_norm", x, weight, epsilon)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, as Llama defines it.

    The mean of squares is taken in float32 (float64 for float64 input), the normalised value is
    rounded to ``x``'s dtype, then scaled by ``weight``. ``x`` and ``weight`` may be strided views;
    the output is a new contiguous tensor.
    """
    check_rms_norm(x, weight, epsilon)
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    variance = xc.pow(2).mean(dim=-1, keepdim=True)
    return ((xc * torch.rsqrt(variance + epsilon)).to(x.dtype) * weight).contiguous()


def check_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    """Refuse arguments outside ``fused_add_rms_norm``'s contract."""
    _check_norm("fused_add_rms_norm", x, weight, epsilon)
    check_float("fused_add_rms_norm", "residual", residual)
    check_same("fused_add_rms_norm", "residual", residual, "x", x)
    if residual.shape != x.shape:
        raise OpInputError(
            f"fused_add_rms_norm: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match"
        )
    check_writable("fused_add_rms_norm", "residual", residual)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> torch.Tensor:
    """Add ``x`` into ``residual`` in place (rounded to its dtype), then return ``rms_norm`` of the sum.

    This is a Llama decoder layer's ``residual = x + residual; h = norm(residual)`` in one pass.
    ``residual`` may be a view (a slice of a wider buffer): it is updated through it, and nothing
    else of its storage is written.
    """
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    residual.add_(x)
    return rms_norm_reference(residual, weight, epsilon)


def _rms_norm_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def rows(tokens: int, hidden: int, scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(tokens, hidden, generator=gen)

    def case(label: str, x: torch.Tensor, epsilon: float = 1e-6) -> SampleInput:
        w = (1 + 0.1 * torch.randn(x.shape[-1], generator=gen)).to(device, dtype)
        return SampleInput(label, (x.to(device, dtype), w, epsilon))

    # Hidden states carry a few channels hundreds of times larger than the rest ("massive
    # activations"): in float16 their squares overflow (> 65504) unless the sum is taken in float32.
    massive = rows(8, 8192)
    massive[:, ::1024] = 1500.0 * torch.sign(torch.randn(8, 8, generator=gen))
    # x as the first third of a wider row (a fused projection's output): rows 3 * 2048 elements apart
    fused = rows(5, 3 * 2048).to(device, dtype)
    return [
        case("small", rows(7, 64)),
        case("one token", rows(1, 256)),
        case("llama3-8b decode", rows(4, 4096)),
        case("llama3-8b prefill", rows(64, 4096)),
        # Mean of squares ~1e-6 against epsilon 1e-2: a provider that drops or fixes epsilon is off 100x.
        case("epsilon dominates", rows(3, 128, 1e-3), 1e-2),
        # Wide rows stress accumulation: a sum of squares kept in 16 bits loses precision there.
        case("llama3-70b rows (8192 features)", rows(16, 8192)),
        case("llama3-405b rows (16384 features)", rows(4, 16384)),
        case("odd row width 12345", rows(4, 12345)),
        case("large-magnitude rows", massive),
        # Mean of squares 0.0025 against epsilon 1e-3: epsilon moves every output by a fifth.
        case("epsilon 1e-3 at 8192 features", rows(4, 8192, 0.05), 1e-3),
        SampleInput(
            "x a slice of a wider row", (fused[:, :2048], (1 + 0.1 * rows(1, 2048)[0]).to(device, dtype), 1e-6)
        ),
    ]


def _fused_add_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    samples = []
    for s in _rms_norm_samples(dtype, device, gen):
        x = s.args[0]
        if x.is_contiguous():
            residual = torch.randn(x.shape, generator=gen).to(device, dtype)
        else:  # the residual stream as a view too, updated in place through it
            residual = torch.randn(x.shape[0], 2 * x.shape[1], generator=gen).to(device, dtype)[:, x.shape[1] :]
        samples.append(SampleInput(s.label, (x, residual, *s.args[1:])))
    return samples


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
        ErrorInput(
            "residual an expanded view",
            (x, torch.zeros(8, device=device).expand(2, 8), torch.ones(8, device=device), 1e-6),
            "residual is an expanded view",
        ),
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
    hand_samples=_rms_norm_samples,
    errors=_rms_norm_errors,
    fake=lambda x, weight, epsilon: x.new_empty(x.shape),
    variants=Variants(base="small", rows=("x",), leading=True),
)

fused_add_rms_norm = Op(
    name="fused_add_rms_norm",
    reference=fused_add_rms_norm_reference,
    tolerances=_NORM_TOLERANCES,
    hand_samples=_fused_add_samples,
    errors=_fused_add_errors,
    mutates=("residual",),
    fake=lambda x, residual, weight, epsilon: x.new_empty(x.shape),
    variants=Variants(base="small", rows=("x", "residual"), leading=True),
)
