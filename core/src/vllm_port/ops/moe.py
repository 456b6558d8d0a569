"""Mixture-of-experts: ``fused_moe``, a token's router logits to the weighted sum of its top-k experts' gated MLPs.

One op covers the MoE blocks of Mixtral, Qwen3-MoE, DeepSeek-V2 and Llama-4-style sigmoid routers:

1. **route** (:func:`route`): each token's ``top_k`` experts are those of the largest router
   logits, ties going to the lower expert index; their weights are the scores of those experts,
   ``softmax`` over all experts or ``sigmoid`` of each (float32), optionally renormalised to sum
   to one, then multiplied by ``routed_scaling``;
2. **experts**: each selected expert ``e`` runs its gated MLP on the token,
   ``down_e(act(gate_e(x)) * up_e(x))`` with ``w13[e] = [gate_e; up_e]`` and ``w2[e] = down_e``;
3. **combine**: the weighted sum of the token's expert outputs (float32), plus the shared
   experts' gated MLP unweighted where the model has them (DeepSeek's ``n_shared_experts`` as one
   MLP of their summed width), rounded once to ``x``'s dtype.

The top-k is taken on the logits, not the scores: softmax and sigmoid keep the order, and the logits
are the same bits for every provider, so the choice is exact and the contract leaves nothing to
rounding (two scores that round to one float32 still come from distinct logits). A provider must
honour the tie rule (``torch.topk`` does not promise it; a stable sort does).

Expert parallelism (experts placed on several devices) is not part of the op: see docs/ops.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import OpInputError
from ._checks import check_float, check_same, first_bad, reads_values
from ._op import ErrorInput, Op, SampleInput, Tolerance, Variants
from .linear import packed_rows

__all__ = [
    "MOE_ACTIVATIONS",
    "MOE_SCORINGS",
    "check_fused_moe",
    "expert_mlp",
    "fused_moe",
    "fused_moe_reference",
    "route",
]

#: How router logits become expert weights.
MOE_SCORINGS = ("softmax", "sigmoid")
#: The experts' gate activations: SiLU (Mixtral, Qwen, DeepSeek), exact and tanh-approximated GELU.
MOE_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def check_fused_moe(
    x,
    router_logits,
    w13,
    w2,
    top_k,
    scoring="softmax",
    renormalize=False,
    activation="silu",
    routed_scaling=1.0,
    shared_w13=None,
    shared_w2=None,
) -> None:
    """Refuse arguments outside ``fused_moe``'s contract; router logits are checked for NaN under validation."""
    op = "fused_moe"
    check_float(op, "x", x)
    if x.dim() != 2:
        raise OpInputError(f"{op}: x has shape {tuple(x.shape)}; it must be [num_tokens, hidden_size]")
    tokens, hidden = x.shape
    check_float(op, "router_logits", router_logits)
    if router_logits.dim() != 2 or router_logits.shape[0] != tokens or router_logits.shape[1] < 1:
        raise OpInputError(
            f"{op}: router_logits has shape {tuple(router_logits.shape)}; it must be [num_tokens={tokens}, "
            "num_experts >= 1] (one logit per token and expert)"
        )
    if router_logits.device != x.device:
        raise OpInputError(
            f"{op}: router_logits is on {router_logits.device} but x is on {x.device}; move them to one device"
        )
    experts = router_logits.shape[1]
    for name, w in (("w13", w13), ("w2", w2)):
        check_float(op, name, w)
        check_same(op, name, w, "x", x)
    if w13.dim() != 3 or w13.shape[0] != experts or w13.shape[2] != hidden or w13.shape[1] % 2 or not w13.shape[1]:
        raise OpInputError(
            f"{op}: w13 has shape {tuple(w13.shape)}; it must be [num_experts={experts}, 2 * intermediate, "
            f"hidden_size={hidden}] (each expert's gate rows, then its up rows)"
        )
    inter = w13.shape[1] // 2
    if tuple(w2.shape) != (experts, hidden, inter):
        raise OpInputError(
            f"{op}: w2 has shape {tuple(w2.shape)}; it must be [num_experts={experts}, hidden_size={hidden}, "
            f"intermediate={inter}] (each expert's down projection)"
        )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise OpInputError(f"{op}: top_k must be an int in [1, num_experts={experts}], got {top_k!r}")
    if scoring not in MOE_SCORINGS:
        raise OpInputError(f"{op}: scoring must be one of {', '.join(MOE_SCORINGS)}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise OpInputError(f"{op}: renormalize must be True or False, got {renormalize!r}")
    if activation not in MOE_ACTIVATIONS:
        raise OpInputError(f"{op}: activation must be one of {', '.join(MOE_ACTIVATIONS)}, got {activation!r}")
    if (
        isinstance(routed_scaling, bool)
        or not isinstance(routed_scaling, (int, float))
        or not (math.isfinite(routed_scaling) and routed_scaling > 0)
    ):
        raise OpInputError(f"{op}: routed_scaling must be a finite number > 0 (1.0: none), got {routed_scaling!r}")
    _check_shared(x, shared_w13, shared_w2)
    if reads_values(router_logits):
        at = first_bad(router_logits.isnan())
        if at is not None:
            raise OpInputError(f"{op}: router_logits[{at[0]}, {at[1]}] is NaN; no expert can be chosen by it")


def _check_shared(x: torch.Tensor, shared_w13: object, shared_w2: object) -> None:
    op = "fused_moe"
    if (shared_w13 is None) != (shared_w2 is None):
        raise OpInputError(f"{op}: pass shared_w13 and shared_w2 together (the shared experts' MLP), or neither")
    if shared_w13 is None:
        return
    hidden = x.shape[1]
    for name, w in (("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        check_float(op, name, w)
        check_same(op, name, w, "x", x)
    if shared_w13.dim() != 2 or shared_w13.shape[1] != hidden or shared_w13.shape[0] % 2 or not shared_w13.shape[0]:
        raise OpInputError(
            f"{op}: shared_w13 has shape {tuple(shared_w13.shape)}; it must be [2 * shared_intermediate, "
            f"hidden_size={hidden}]"
        )
    if tuple(shared_w2.shape) != (hidden, shared_w13.shape[0] // 2):
        raise OpInputError(
            f"{op}: shared_w2 has shape {tuple(shared_w2.shape)}; it must be [hidden_size={hidden}, "
            f"shared_intermediate={shared_w13.shape[0] // 2}]"
        )


def route(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, routed_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights: ``(weights [tokens, top_k] float32, ids [tokens, top_k] int64)``.

    The ids are those of the ``top_k`` largest logits, largest first, the lower index first among
    equal logits (a stable sort); weights are float64 for float64 logits. No argument checks: the
    op's check runs first.
    """
    compute = torch.promote_types(router_logits.dtype, torch.float32)
    logits = router_logits.to(compute)
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling, ids


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, activation: str) -> torch.Tensor:
    """One expert's gated MLP in ``x``'s dtype: ``(act(x @ gate.T) * (x @ up.T)) @ w2.T``, each product rounded once."""
    gate, up = F.linear(packed_rows(x), w13).chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    else:
        act = F.gelu(gate, approximate="none" if activation == "gelu" else "tanh")
    return F.linear(act * up, w2)


def fused_moe_reference(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    activation: str = "silu",
    routed_scaling: float = 1.0,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE block's output ``[num_tokens, hidden_size]`` in ``x``'s dtype (see the module docstring).

    Args:
        x: ``[num_tokens, hidden_size]`` tokens (the post-attention norm's output).
        router_logits: ``[num_tokens, num_experts]``, any float dtype (the router's ``linear``).
        w13: ``[num_experts, 2 * intermediate, hidden_size]``: each expert's gate rows, then its up rows.
        w2: ``[num_experts, hidden_size, intermediate]``: each expert's down projection.
        top_k: experts per token.
        scoring: ``"softmax"`` over every expert's logit, or ``"sigmoid"`` of each.
        renormalize: divide the chosen weights by their sum (Mixtral; Qwen3-MoE's ``norm_topk_prob``).
        activation: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        routed_scaling: multiplies the routed weights (DeepSeek's ``routed_scaling_factor``).
        shared_w13, shared_w2: the shared experts' gated MLP (``[2 * s, hidden]``, ``[hidden, s]``),
            added to every token unweighted; both None without shared experts.

    Every weight may be a strided view. The experts run one at a time over the tokens that chose
    them (a host read per expert: this is the oracle, not a kernel).
    """
    check_fused_moe(x, router_logits, w13, w2, top_k, scoring, renormalize, activation, routed_scaling, shared_w13,
                    shared_w2)  # fmt: skip
    weights, ids = route(router_logits, top_k, scoring, renormalize, routed_scaling)
    compute = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        y = expert_mlp(x[token], w13[e], w2[e], activation).to(compute)
        out.index_add_(0, token, y * weights[token, slot, None].to(compute))
    if shared_w13 is not None:
        out += expert_mlp(x, shared_w13, shared_w2, activation).to(compute)
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Samples
# ------------------------------------------------------------------------------------------------

#: (hidden, intermediate, experts, top_k, shared intermediate, renormalize) of the real models.
_MODELS = {
    "mixtral-8x7b": (4096, 14336, 8, 2, 0, True),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, True),
    "deepseek-v2-lite": (2048, 1408, 64, 6, 2 * 1408, False),
}
#: Token counts of the real-model samples (device runs only): decode batches to a long prefill.
_MODEL_TOKENS = {"mixtral-8x7b": (1, 64, 2048), "qwen3-30b-a3b": (1, 8, 64, 4096, 8192), "deepseek-v2-lite": (1, 512)}


def _weights(experts, hidden, inter, shared, dtype, device, gen) -> tuple[torch.Tensor, ...]:
    """Expert weights scaled so each product has unit variance (as trained layers roughly do)."""

    def randn(*shape: int, scale: float) -> torch.Tensor:
        if device.type == "cpu":
            return (scale * torch.randn(*shape, generator=gen)).to(dtype)
        local = torch.Generator(device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
        return (scale * torch.randn(*shape, generator=local, device=device, dtype=torch.float32)).to(dtype)

    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5).to(device)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5).to(device)
    if not shared:
        return w13, w2, None, None
    return (
        w13,
        w2,
        randn(2 * shared, hidden, scale=hidden**-0.5).to(device),
        randn(hidden, shared, scale=shared**-0.5).to(device),
    )


def _distinct_logits(tokens: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Router logits without ties in any row even in bfloat16: a permutation of a grid 0.05 apart, per row."""
    grid = (torch.arange(experts, dtype=torch.float32) - experts / 2) * (4.0 / max(experts, 8))
    order = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)
    return grid[order]


def _case(label, tokens, hidden, inter, experts, top_k, shared, dtype, device, gen, *, scoring="softmax",
          renormalize=False, activation="silu", routed_scaling=1.0, large=False, logits_dtype=None,
          weights=None) -> SampleInput:  # fmt: skip
    w13, w2, s13, s2 = weights or _weights(experts, hidden, inter, shared, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    logits = _distinct_logits(tokens, experts, gen).to(device, logits_dtype or dtype)
    args = (x, logits, w13, w2, top_k, scoring, renormalize, activation, routed_scaling, s13, s2)
    return SampleInput(label, args, large)


def _moe_samples(dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
    def case(label, tokens, hidden, inter, experts, top_k, shared=0, **kw):
        return _case(label, tokens, hidden, inter, experts, top_k, shared, dtype, device, gen, **kw)

    samples = [
        case("small", 5, 32, 16, 6, 2, 24, renormalize=True),  # the variants' base: every argument read
        case("one token (decode)", 1, 48, 32, 8, 2),
        case("mixtral routing (8 experts, top-2, renormalised), small widths", 7, 64, 96, 8, 2, renormalize=True),
        case("qwen3-moe routing (128 experts, top-8, renormalised), small widths", 33, 64, 32, 128, 8,
             renormalize=True),
        case("deepseek-v2-lite routing (64 routed + 2 shared, top-6), small widths", 17, 64, 24, 64, 6, 48),
        case("routed_scaling 2.5 with shared experts", 9, 32, 16, 16, 3, 32, routed_scaling=2.5),
        case("sigmoid scoring, top-1 (llama-4 style)", 11, 32, 24, 16, 1, 16, scoring="sigmoid"),
        case("sigmoid scoring, renormalised top-4", 13, 32, 16, 32, 4, scoring="sigmoid", renormalize=True),
        case("gelu (erf) experts", 6, 32, 20, 8, 2, 16, activation="gelu"),
        case("gelu (tanh) experts", 6, 32, 20, 8, 2, activation="gelu_tanh"),
        case("more experts than tokens choose (most idle)", 2, 32, 16, 64, 2),
        case("every expert chosen by every token", 4, 32, 16, 4, 4, renormalize=True),
        case("router logits in float32", 8, 32, 16, 8, 2, logits_dtype=torch.float32),
        case("odd widths (hidden 72, intermediate 40)", 9, 72, 40, 8, 3),
        _tied(case("tied router logits: the lower expert index wins", 6, 32, 16, 8, 3)),
        _as_views(case("x, logits and every weight strided views", 5, 32, 16, 8, 2, 16, renormalize=True)),
    ]  # fmt: skip
    if device.type != "cpu":  # the real models' layers: gigabytes of weights, for devices only
        for model, (hidden, inter, experts, top_k, shared, renorm) in _MODELS.items():
            weights = _weights(experts, hidden, inter, shared, dtype, device, gen)
            for tokens in _MODEL_TOKENS[model]:
                samples.append(
                    case(f"{model} layer, {tokens} tokens", tokens, hidden, inter, experts, top_k, shared,
                         renormalize=renorm, weights=weights, large=True)
                )  # fmt: skip
    return samples


def _tied(sample: SampleInput) -> SampleInput:
    """``sample`` with router logits of a few integer values, so every row ties at its top-k edge."""
    x, logits, *rest = sample.args
    ties = torch.arange(logits.numel(), device=logits.device).remainder(3).view(logits.shape).to(logits.dtype)
    return SampleInput(sample.label, (x, ties, *rest), sample.large)


def _as_views(sample: SampleInput) -> SampleInput:
    """``sample`` with ``x``, the logits, ``w2`` and ``shared_w2`` slices of wider rows, ``w13`` and ``shared_w13`` transposed views."""
    x, logits, w13, w2, *rest, s13, s2 = sample.args

    def sliced(t: torch.Tensor) -> torch.Tensor:  # the first columns of wider rows, NaN beyond them
        wide = torch.full((*t.shape[:-1], t.shape[-1] + 8), float("nan"), dtype=t.dtype, device=t.device)
        wide[..., : t.shape[-1]] = t
        return wide[..., : t.shape[-1]]

    def transposed(t: torch.Tensor) -> torch.Tensor:  # the same values, last two dimensions' strides swapped
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)

    return SampleInput(
        sample.label, (sliced(x), sliced(logits), transposed(w13), sliced(w2), *rest, transposed(s13), sliced(s2))
    )


def _moe_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(3, 8, device=device)
    logits = torch.randn(3, 4, device=device)
    w13, w2 = torch.randn(4, 12, 8, device=device), torch.randn(4, 8, 6, device=device)
    good = (x, logits, w13, w2, 2, "softmax", False, "silu", 1.0, None, None)

    def but(i, value, *more):
        args = [value if j == i else a for j, a in enumerate(good)]
        for j, v in more:
            args[j] = v
        return tuple(args)

    return [
        ErrorInput("3-D x", but(0, x[None]), "[num_tokens, hidden_size]"),
        ErrorInput("router logits of another token count", but(1, logits[:2]), "router_logits has shape"),
        ErrorInput("w13 of another hidden size", but(2, w13[:, :, :4]), "w13 has shape"),
        ErrorInput("w13 of odd width", but(2, w13[:, :11]), "w13 has shape"),
        ErrorInput("w2 of another intermediate", but(3, w2[:, :, :5]), "w2 has shape"),
        ErrorInput("weights of another dtype", but(2, w13.half()), "cast them to one dtype"),
        ErrorInput("top_k above the experts", but(4, 5), "top_k must be an int in [1, num_experts=4]"),
        ErrorInput("top_k 0", but(4, 0), "top_k must be"),
        ErrorInput("unknown scoring", but(5, "softplus"), "scoring must be one of"),
        ErrorInput("renormalize not a bool", but(6, 1), "renormalize must be"),
        ErrorInput("unknown activation", but(7, "relu"), "activation must be one of"),
        ErrorInput("routed_scaling 0", but(8, 0.0), "routed_scaling must be"),
        ErrorInput("shared_w13 without shared_w2", but(9, torch.randn(8, 8, device=device)), "together"),
        ErrorInput(
            "shared_w2 of another width",
            but(9, torch.randn(8, 8, device=device), (10, torch.randn(8, 3, device=device))),
            "shared_w2 has shape",
        ),
        ErrorInput("integer x", but(0, x.long()), "x has dtype"),
    ]


def _moe_value_errors(device: torch.device) -> list[ErrorInput]:
    x = torch.randn(2, 8, device=device)
    logits = torch.randn(2, 4, device=device)
    logits[1, 2] = float("nan")
    args = (x, logits, torch.randn(4, 12, 8, device=device), torch.randn(4, 8, 6, device=device), 2)
    return [ErrorInput("a NaN router logit", args, "router_logits[1, 2] is NaN")]


fused_moe = Op(
    name="fused_moe",
    reference=fused_moe_reference,
    tolerances={
        torch.float32: Tolerance(
            1e-4, 1e-4, "two float32 GEMMs of up to 14336 products each, summed in another order (tiles, split-K)"
        ),
        torch.bfloat16: Tolerance(
            3e-2, 3e-2, "bfloat16 rounds the up/gate products, the activation and each expert's output (8 bits each)"
        ),
        torch.float16: Tolerance(
            4e-3, 4e-3, "float16 rounds the up/gate products, the activation and each expert's output (11 bits each)"
        ),
    },
    hand_samples=_moe_samples,
    errors=_moe_errors,
    value_errors=_moe_value_errors,
    fake=lambda x, *_args, **_kw: x.new_empty(x.shape),
    variants=Variants(base="small", rows=("x", "router_logits")),
)
