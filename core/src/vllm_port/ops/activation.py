"""Gated activation ops: ``act(x[..., :d]) * x[..., d:]``, as the MLPs of Llama-family models use."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import OpInputError
from ._checks import check_float
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants


def check_gated(op: str, x: torch.Tensor) -> int:
    """Refuse arguments outside a gated activation's contract; return the output width ``d``."""
    check_float(op, "x", x)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise OpInputError(f"{op}: x has shape {tuple(x.shape)}; its last dimension must be even (gate and up halves)")
    return x.shape[-1] // 2


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` in ``x``'s dtype, with ``d = x.shape[-1] // 2``.

    ``x`` may be a strided view; the output is a new contiguous tensor.
    """
    d = check_silu_and_mul(x)
    return (F.silu(x[..., :d]) * x[..., d:]).contiguous()


def check_silu_and_mul(x: torch.Tensor) -> int:
    """Refuse arguments outside ``silu_and_mul``'s contract; return the output width ``d``."""
    return check_gated("silu_and_mul", x)


def check_gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> int:
    """Refuse arguments outside ``gelu_and_mul``'s contract; return the output width ``d``."""
    d = check_gated("gelu_and_mul", x)
    if approximate not in ("none", "tanh"):
        raise OpInputError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    return d


def gelu_and_mul_reference(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` in ``x``'s dtype; ``approximate`` is ``"none"`` or ``"tanh"``."""
    d = check_gelu_and_mul(x, approximate)
    return (F.gelu(x[..., :d], approximate=approximate) * x[..., d:]).contiguous()


def _gated_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label: str, tokens: int, width: int, scale: float = 1.0) -> SampleInput:
        return SampleInput(label, ((scale * torch.randn(tokens, 2 * width, generator=gen)).to(device, dtype),))

    # gate and up halves as a slice of a wider row: rows 3 * 2 * 1536 elements apart
    fused = (2 * torch.randn(4, 3 * 2 * 1536, generator=gen)).to(device, dtype)
    return [
        case("small", 5, 48),
        case("one token", 1, 128),
        case("llama3-8b decode", 4, 14336),
        case("llama3-8b prefill", 32, 14336),
        case("qwen2.5-7b decode (width 18944)", 2, 18944, 2.0),
        case("llama3-405b decode (width 53248)", 1, 53248, 2.0),
        case("odd width 1001", 3, 1001, 3.0),
        # tensor-parallel shards of llama2-7b's 11008-wide MLP: 5504 (tp 2) is no multiple of 256, 1376 (tp 8) of 64
        case("width 5504 (11008 / 2, a tensor-parallel shard)", 3, 5504),
        case("width 1376 (11008 / 8), 65 tokens", 65, 1376),
        SampleInput("x a slice of a wider row", (fused[:, : 2 * 1536],)),
    ]


def _gelu_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    # "tanh" on every shape whose size is not the point, and on one wide row (the two differ by up to 1e-3)
    samples = _gated_samples(dtype, device, gen)
    tanh = [s for s in samples if "llama3" not in s.label] + [samples[2]]
    return samples + [SampleInput(s.label + ", tanh", (*s.args, "tanh")) for s in tanh]


def _gated_errors(device: torch.device) -> list[ErrorInput]:
    return [
        ErrorInput("odd last dimension", (torch.randn(3, 7, device=device),), "must be even"),
        ErrorInput("integer input", (torch.ones(3, 8, device=device, dtype=torch.int64),), "x has dtype"),
    ]


_GATED_TOLERANCES = {
    torch.float32: Tolerance(1e-5, 1e-5, "exp and division round differently across math libraries"),
    torch.bfloat16: Tolerance(1e-2, 1.6e-2, "bfloat16 keeps 8 significant bits: silu and the product each round"),
    torch.float16: Tolerance(1e-3, 2e-3, "float16 keeps 11 significant bits: silu and the product each round"),
}


def _gated_fake(x: torch.Tensor, *_: object) -> torch.Tensor:  # contiguous, as every provider returns
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


silu_and_mul = Op(
    name="silu_and_mul",
    reference=silu_and_mul_reference,
    tolerances=_GATED_TOLERANCES,
    hand_samples=_gated_samples,
    errors=_gated_errors,
    fake=_gated_fake,
    variants=Variants(base="small", rows=("x",), leading=True),
)

gelu_and_mul = Op(
    name="gelu_and_mul",
    reference=gelu_and_mul_reference,
    tolerances=_GATED_TOLERANCES,
    hand_samples=_gelu_samples,
    errors=lambda device: [
        *_gated_errors(device),
        ErrorInput("unknown approximation", (torch.randn(2, 8, device=device), "fast"), "approximate"),
    ],
    fake=_gated_fake,
    variants=Variants(base="small", rows=("x",), leading=True),
)
