"""FP8 linear: an e4m3 weight with its scales, times activations a provider may quantise per token on the fly.

``fp8_linear(x, weight, weight_scale, bias=None)`` is ``x @ dequantize(weight, weight_scale).T + bias``
in ``x``'s dtype, where ``weight`` is ``float8_e4m3fn`` ``[out_features, in_features]`` and
``weight_scale`` float32 multiplies it (:func:`dequantize_fp8_weight`), in one of three granularities:

- per tensor: ``[]`` or ``[1]`` (vLLM's and transformers' per-tensor ``weight_scale``);
- per output channel: ``[out_features]`` (compressed-tensors' ``channel`` strategy, or per-tensor
  scales of fused q/k/v parts, expanded exactly);
- per output row and group of :data:`FP8_GROUP` input features: ``[out_features, ceil(in / 128)]``
  (DeepSeek-V3's and Qwen3-FP8's 128 x 128 blocks, the block's scale repeated over its rows, exactly).

Why an op of its own and not a ``linear`` with optional scales: ``linear``'s contract (one float
dtype for every argument, tolerances of a float product) is certified as it stands by every plugin;
an FP8 weight changes what is checked (the dtype pair, the scale shapes, a tolerance that admits
activation quantisation), and a plugin that has no FP8 path keeps its certified ``linear`` and gets
the reference here, rather than losing certification of ``linear``.

What a provider may do: quantise each row (token) of ``x`` to e4m3 on the fly with the scale
``max(amax(|row|), 1e-12) / 448`` (round to nearest), multiply in FP8 with float32 accumulation
(tensor cores, ``torch._scaled_mm``), and scale the result, or compute the dequantised product
exactly (the CPU provider and the reference do). The oracle is the exact product in float64, and
the tolerance is derived from what per-token quantisation costs each output (:func:`_check_fp8`):
an element of ``x`` rounded to e4m3 errs by at most half an e4m3 step at its magnitude (a relative
2^-4 for normal values), uniformly, so output ``i`` errs by a sum of independent terms with standard
deviation ``sigma_i = sqrt(sum_k h_k^2 / 3 * w_ik^2)``. A provider passes within ``6 sigma_i`` plus
the output dtype's rounding per element, and (on samples of 4096 outputs or more) with a mean error
of at most 1.5 times what that quantisation gives on average: so a provider that rounds to e5m2, or
scales a whole batch by one amax (small rows lose their precision), fails, while an exact one passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import OpInputError
from ._checks import check_float, first_bad, reads_values
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants
from .linear import nan_padded_rows

__all__ = [
    "FP8_DTYPE",
    "FP8_GROUP",
    "FP8_MAX",
    "check_fp8_linear",
    "dequantize_fp8_weight",
    "fp8_linear",
    "fp8_linear_reference",
    "quantize_fp8_rows",
    "quantize_fp8_weight",
    "scale_granularity",
]

#: The weight dtype: OCP FP8 e4m3 (finite, no infinities; what Hopper's tensor cores and cuBLASLt take).
FP8_DTYPE = torch.float8_e4m3fn
#: Its largest finite value.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Input features per scale group in the grouped granularity (``weight_scale`` ``[out, ceil(in / 128)]``).
FP8_GROUP = 128
#: The smallest per-token amax a quantiser divides by (an all-zero row quantises to zeros).
_AMAX_FLOOR = 1e-12
#: Standard deviations of per-token quantisation error an output element may be off (see the module docstring).
_SIGMAS = 6.0
#: The mean error may be this many times the expected mean error of per-token quantisation.
_MEAN_FACTOR = 1.5
#: Outputs a sample needs before its mean error is judged (as ``Op.check``'s statistics).
_STATS_MIN = 4096


def scale_granularity(weight: torch.Tensor, weight_scale: torch.Tensor) -> str | None:
    """``"tensor"``, ``"channel"`` or ``"group"``: what ``weight_scale``'s shape means for ``weight``; None for none."""
    n, k = weight.shape
    shape = tuple(weight_scale.shape)
    if shape in ((), (1,)):
        return "tensor"
    if shape == (n,):
        return "channel"
    if shape == (n, -(-k // FP8_GROUP)):
        return "group"
    return None


def check_fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """Refuse arguments outside ``fp8_linear``'s contract; the scales' values are checked under validation."""
    op = "fp8_linear"
    check_float(op, "x", x)
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise OpInputError(
            f"{op}: weight must be a torch.float8_e4m3fn tensor, got {got}; quantise it first "
            "(vllm_port.ops.fp8.quantize_fp8_weight) or call linear for a float weight"
        )
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise OpInputError(
            f"{op}: x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; weight must be "
            "[out_features, in_features] with in_features equal to x's last dimension"
        )
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float32:
        got = weight_scale.dtype if isinstance(weight_scale, torch.Tensor) else type(weight_scale).__name__
        raise OpInputError(f"{op}: weight_scale must be a float32 tensor, got {got}")
    if scale_granularity(weight, weight_scale) is None:
        n, k = weight.shape
        raise OpInputError(
            f"{op}: weight_scale has shape {tuple(weight_scale.shape)}; for a weight of {n} x {k} it must be [] or "
            f"[1] (per tensor), [{n}] (per output channel) or [{n}, {-(-k // FP8_GROUP)}] (per row and group of "
            f"{FP8_GROUP} input features)"
        )
    for arg, t in (("weight", weight), ("weight_scale", weight_scale)):
        if t.device != x.device:
            raise OpInputError(f"{op}: {arg} is on {t.device} but x is on {x.device}; move them to one device")
    if bias is not None:
        check_float(op, "bias", bias)
        if bias.dtype != x.dtype or bias.device != x.device or bias.shape != (weight.shape[0],):
            raise OpInputError(
                f"{op}: bias is {bias.dtype} {tuple(bias.shape)} on {bias.device}; it must be x's dtype "
                f"({x.dtype}), [{weight.shape[0]}] (out_features), on x's device"
            )
    if reads_values(weight_scale, weight):
        at = first_bad(~(weight_scale.isfinite() & (weight_scale > 0)))
        if at is not None:
            where = ", ".join(map(str, at))
            raise OpInputError(f"{op}: weight_scale[{where}] is {float(weight_scale[at]):g}; a scale is finite and > 0")
        at = first_bad(weight.isnan())
        if at is not None:
            raise OpInputError(f"{op}: weight[{at[0]}, {at[1]}] is NaN; an FP8 weight holds finite values")


def dequantize_fp8_weight(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * weight_scale`` in ``dtype`` ``[out, in]``, each scale over its tensor, channel or group.

    The product is taken in float32 (float64 for float64) and rounded once to ``dtype``.
    """
    compute = torch.promote_types(dtype, torch.float32)
    return (weight.to(compute) * _expanded(weight_scale.to(compute), *weight.shape)).to(dtype)


def _expanded(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``scale`` shaped to broadcast over an ``[n, k]`` weight: ``[]``, ``[n, 1]`` or ``[n, k]`` (groups repeated)."""
    if scale.dim() == 2:
        return scale.repeat_interleave(FP8_GROUP, dim=1)[:, :k]
    if scale.shape == (n,) and n != 1:
        return scale[:, None]
    return scale.reshape(())


def quantize_fp8_weight(weight: torch.Tensor, granularity: str = "channel") -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn weight, float32 weight_scale)`` of a float ``[out, in]`` weight, round to nearest.

    ``granularity``: ``"tensor"`` (scale ``[]``), ``"channel"`` (``[out]``) or ``"group"`` (``[out, ceil(in / 128)]``):
    each scale is its span's amax / 448, so the span's largest magnitude is stored exactly.
    """
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if granularity == "tensor":
        amax = w.abs().amax()
    elif granularity == "channel":
        amax = w.abs().amax(dim=1)
    elif granularity == "group":
        groups = -(-k // FP8_GROUP)
        padded = F.pad(w.abs(), (0, groups * FP8_GROUP - k))
        amax = padded.view(n, groups, FP8_GROUP).amax(dim=2)
    else:
        raise ValueError(f"granularity must be 'tensor', 'channel' or 'group', got {granularity!r}")
    scale = amax.clamp(min=_AMAX_FLOOR) / FP8_MAX
    q = (w / _expanded(scale, n, k)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale.to(torch.float32)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantisation of ``x`` ``[..., in]``: ``(float8_e4m3fn [..., in], float32 scale [..., 1])``.

    The scale is ``max(amax(|row|), 1e-12) / 448``; a provider that quantises activations does this.
    """
    xf = x.to(torch.float32)
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ dequantize_fp8_weight(weight, weight_scale).T + bias`` in ``x``'s dtype, ``[*x.shape[:-1], out]``.

    The exact dequantised product (float32 accumulation, float64 for float64), rounded once to
    ``x``'s dtype; no activation quantisation. Every argument may be a strided view; the output is
    a new contiguous tensor.
    """
    check_fp8_linear(x, weight, weight_scale, bias)
    compute = torch.promote_types(x.dtype, torch.float32)
    w = dequantize_fp8_weight(weight, weight_scale, compute)
    b = bias.to(compute) if bias is not None else None
    return F.linear(x.to(compute), w, b).to(x.dtype).contiguous()


def _half_steps(x: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each element of float64 ``x`` under its row's per-token scale (in ``x``'s units)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) / FP8_MAX
    v = (x / scale).abs()
    exponent = torch.floor(torch.log2(v.clamp(min=2.0**-6))).clamp(min=-6)  # subnormals share 2^-6's step
    return 2.0 ** (exponent - 4) * scale  # e4m3 keeps 3 fraction bits: a step is 2^(e-3), half of it 2^(e-4)


def _oracle(x, weight, weight_scale, bias) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 dequantised product ``[rows, out]``, each output's quantisation deviation ``sigma``, and its
    size ``sqrt(sum_k x_k^2 w_k^2)`` (what the tolerance's ``atol`` scales with: a row of tokens a thousand
    times smaller rounds a thousand times less).

    Computed :data:`_ORACLE_CHUNK` output features at a time, so a float64 copy of a large weight never exists whole.
    """
    xd = x.detach().cpu().double().reshape(-1, x.shape[-1])
    # the tolerance's two sums in float32 (a tolerance needs no float64 digits; they cost two of the three products)
    var = (_half_steps(xd) ** 2 / 3).float()
    squares = (xd * xd).float()
    weight, weight_scale = weight.detach().cpu(), weight_scale.detach().cpu()
    granularity = scale_granularity(weight, weight_scale)
    want, sigma, size = [], [], []
    for start in range(0, weight.shape[0], _ORACLE_CHUNK):
        rows = slice(start, start + _ORACLE_CHUNK)
        scale = weight_scale if granularity == "tensor" else weight_scale[rows]
        w = dequantize_fp8_weight(weight[rows], scale, torch.float64)
        want.append(xd @ w.T)
        w2 = (w * w).float().T
        sigma.append((var @ w2).sqrt().double())
        size.append((squares @ w2).sqrt().double())
    bias_d = bias.detach().cpu().double() if bias is not None else 0.0
    return torch.cat(want, dim=1) + bias_d, torch.cat(sigma, dim=1), torch.cat(size, dim=1)


#: Output features the oracle dequantises to float64 at once.
_ORACLE_CHUNK = 2048


def _check_fp8(op: Op, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
    """Values within the per-token quantisation's error of the float64 dequantised product (module docstring)."""
    x, weight, weight_scale = args[:3]
    bias = args[3] if len(args) > 3 else None
    before = [a.detach().clone() for a in args if isinstance(a, torch.Tensor)]
    got = fn(*args)
    shape = (*x.shape[:-1], weight.shape[0])
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape or got.dtype != x.dtype:
        what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return f"output: returned {what}; the op returns {x.dtype} {shape}"
    if not got.is_contiguous():
        return (
            f"output: has strides {got.stride()} for shape {tuple(got.shape)}; the contract returns contiguous tensors"
        )
    after = [a for a in args if isinstance(a, torch.Tensor)]
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if not torch.equal(b.view(torch.uint8) if b.dtype == FP8_DTYPE else b.nan_to_num(0.0),
                           a.view(torch.uint8) if a.dtype == FP8_DTYPE else a.nan_to_num(0.0)):  # fmt: skip
            return f"argument {i} was modified, but the op only reads it"
    want, sigma, size = _oracle(x, weight, weight_scale, bias)
    tol = op.tolerances[dtype]
    rounding = tol.atol * size + tol.rtol * want.abs()
    err = (got.detach().cpu().double().reshape(want.shape) - want).abs()
    bad = ~(err <= rounding + _SIGMAS * sigma)  # NaN is bad
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        value = float(got.detach().reshape(want.shape)[r, c])
        return (
            f"output: {int(bad.sum())} of {bad.numel()} elements off; first at row {r}, column {c}: got {value:.6g}, "
            f"expected {float(want[r, c]):.6g}, allowed {float(rounding[r, c] + _SIGMAS * sigma[r, c]):.3g} "
            f"({tol.atol} x {float(size[r, c]):.3g} + {tol.rtol} x |expected| for the output's rounding and "
            f"accumulation, {_SIGMAS:g} x {float(sigma[r, c]):.3g} "
            "for per-token e4m3 quantisation of x)"
        )
    if want.numel() >= _STATS_MIN:
        best = (want.to(dtype).double() - want).abs().mean()
        expected = math.sqrt(2 / math.pi) * float(sigma.mean()) + float(best)
        mean = float(err.mean())
        if mean > _MEAN_FACTOR * expected:
            return (
                f"output: mean error {mean:.3g} over {want.numel()} elements is {mean / expected:.2f}x what per-token "
                f"e4m3 quantisation of x gives on average ({expected:.3g}; at most {_MEAN_FACTOR}x allowed): "
                "activations rounded more coarsely than e4m3 per token, or a lower-precision step"
            )
    return None


# ------------------------------------------------------------------------------------------------
# samples and error inputs
# ------------------------------------------------------------------------------------------------


def _fp8_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def weight(n: int, k: int, granularity: str, channel_spread: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.randn(n, k, generator=gen) / k**0.5  # outputs near unit scale
        if channel_spread:  # channels of very different magnitudes: their scales differ as much
            w = w * torch.logspace(-channel_spread, channel_spread, n)[torch.randperm(n, generator=gen)][:, None]
        q, s = quantize_fp8_weight(w, granularity)
        return q.to(device), s.to(device)

    def case(label, tokens, k, n, granularity, *, bias=False, large=False, row_spread=0.0, channel_spread=0.0):
        x = torch.randn(tokens, k, generator=gen)
        if row_spread:  # tokens of very different magnitudes: one amax for the batch loses the small ones
            x = x * torch.logspace(-row_spread, row_spread, tokens)[:, None]
        q, s = weight(n, k, granularity, channel_spread)
        b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
        return SampleInput(label, (x.to(device, dtype), q, s, b), large=large)

    x = torch.randn(5, 256, generator=gen).to(device, dtype)
    q, s = weight(96, 256, "channel")
    transposed = q.t().contiguous().t()  # stored [in_features, out_features]
    wide = torch.randn(6, 3 * 256, generator=gen).to(device, dtype)[:, 256:512]
    padded = nan_padded_rows(torch.randn(36, 3, generator=gen).to(device, dtype))
    samples = [
        case("small, per tensor", 7, 64, 48, "tensor"),
        case("small, per channel, bias", 7, 64, 48, "channel", bias=True),
        case("groups of 128, in_features 320 (a partial group)", 9, 320, 40, "group"),
        case("per-channel scales across 6 decades", 4, 128, 64, "channel", channel_spread=3.0),
        case("tokens across 6 decades of magnitude", 16, 256, 64, "channel", row_spread=3.0),
        case("64 rows, 512 -> 256 (error statistics)", 64, 512, 256, "channel"),
        case("one row, per tensor, bias", 1, 384, 192, "tensor", bias=True),
        # one token is a path of its own in device kernels (no quantising launch: see kernels/triton/fp8_linear.py)
        case("one row, per-channel scales across 6 decades", 1, 256, 96, "channel", channel_spread=3.0),
        SampleInput("transposed weight (a view)", (x, transposed, s, None)),
        SampleInput("x a slice of a wider row", (wide, *weight(72, 256, "group"), None)),
        # rows of odd length with NaN between them: torch's CPU bfloat16 GEMM reads it (see packed_rows)
        SampleInput("x rows of 3 padded with NaN to 4, 36 x 38 outputs", (padded, *weight(38, 3, "tensor"), None)),
    ]
    if device.type != "cpu":
        # the shapes of real models, for devices only (as fused_moe's): the CPU provider dequantises exactly, so
        # their point is a device kernel's tiling, and on CPU making and checking them took 5 of the op's 6 s a
        # dtype in every certification (gate_up's 4096 -> 28672 is the benchmark's: its weight takes seconds to make)
        samples += [
            case("llama3-8b qkv decode (4096 -> 6144)", 4, 4096, 6144, "channel", large=True),
            case("llama3-8b down, 16 rows (14336 -> 4096)", 16, 14336, 4096, "group", large=True),
            case("qwen3-30b-a3b qkv, 256 rows (2048 -> 5120)", 256, 2048, 5120, "tensor", large=True),
            case("qwen3-30b-a3b o_proj, 33 rows (4096 -> 2048)", 33, 4096, 2048, "channel", bias=True, large=True),
        ]
    return samples


def _fp8_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(2, 8, device=device)
    q, s = quantize_fp8_weight(torch.randn(4, 8), "channel")
    q, s = q.to(device), s.to(device)
    return [
        ErrorInput("float weight", (x, torch.randn(4, 8, device=device), s, None), "weight must be a torch.float8_e4m3fn"),
        ErrorInput("in_features mismatch", (torch.randn(2, 7, device=device), q, s, None), "in_features"),
        ErrorInput("scale per input feature", (x, q, torch.ones(8, device=device), None), "weight_scale has shape (8,)"),
        ErrorInput("bfloat16 scale", (x, q, s.bfloat16(), None), "weight_scale must be a float32 tensor"),
        ErrorInput("bias of another dtype", (x, q, s, torch.randn(4, device=device).half()), "bias is torch.float16"),
        ErrorInput("int8 activations", (x.to(torch.int8), q, s, None), "x has dtype torch.int8"),
    ]  # fmt: skip


def _fp8_value_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(2, 8, device=device)
    q, s = quantize_fp8_weight(torch.randn(4, 8), "channel")
    q, s = q.to(device), s.to(device)
    zero = s.clone()
    zero[2] = 0.0
    nan_weight = q.clone()
    nan_weight.view(torch.uint8)[1, 3] = 0x7F  # e4m3fn's NaN
    return [
        ErrorInput("a zero scale", (x, q, zero, None), "weight_scale[2] is 0"),
        ErrorInput("an infinite scale", (x, q, torch.tensor([float("inf")], device=device), None), "weight_scale[0] is inf"),
        ErrorInput("a NaN weight", (x, nan_weight, s, None), "weight[1, 3] is NaN"),
    ]  # fmt: skip


#: The output's rounding and accumulation (``atol`` times the output's size, see :func:`_oracle`); the checker adds
#: per-token e4m3 quantisation of x on top (the module docstring).
_TOLERANCES = {
    torch.float32: Tolerance(1e-4, 1e-4, "float32 sums in another order; plus per-token e4m3 quantisation of x"),
    torch.bfloat16: Tolerance(2e-2, 2e-2, "bfloat16 output rounds to 8 significant bits; plus e4m3 quantisation"),
    torch.float16: Tolerance(2e-3, 2e-3, "float16 output rounds to 11 significant bits; plus e4m3 quantisation"),
}


def _fake_fp8_linear(x, weight, weight_scale, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


fp8_linear = Op(
    name="fp8_linear",
    reference=fp8_linear_reference,
    tolerances=_TOLERANCES,
    hand_samples=_fp8_samples,
    errors=_fp8_errors,
    value_errors=_fp8_value_errors,
    fake=_fake_fp8_linear,
    checker=_check_fp8,
    variants=Variants(base="small, per channel, bias", rows=("x",), leading=True),
)
