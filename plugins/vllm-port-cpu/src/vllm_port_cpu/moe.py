"""The CPU provider of ``fused_moe``: tokens sorted by expert, one pair of matrix products per active expert.

Routing is the contract's (:func:`vllm_port.ops.moe.route`: a stable sort of the logits). Every
(token, expert) pair is then sorted by expert, so each active expert's tokens are one contiguous
slice: one gather of ``x``, one ``linear`` through ``w13[e]``, the activation, one ``linear``
through ``w2[e]`` per expert, and one ``index_add_`` of the weighted outputs at the end. The
expert counts come to the host in one read (the loop needs them); idle experts cost nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_port.ops import provider
from vllm_port.ops.linear import packed_rows
from vllm_port.ops.moe import check_fused_moe, route

__all__ = ["fused_moe"]

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda g: F.gelu(g, approximate="none"),
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act) -> torch.Tensor:
    h = F.linear(packed_rows(x), w13)
    inter = h.shape[-1] // 2
    return F.linear(act(h[:, :inter]).mul_(h[:, inter:]), w2)


@provider("fused_moe", name="cpu_fused_moe", priority=10)
def fused_moe(
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
    check_fused_moe(x, router_logits, w13, w2, top_k, scoring, renormalize, activation, routed_scaling, shared_w13,
                    shared_w2)  # fmt: skip
    act = _ACTIVATIONS[activation]
    weights, ids = route(router_logits, top_k, scoring, renormalize, routed_scaling)
    compute = torch.promote_types(x.dtype, torch.float32)
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    tokens = order // top_k
    pair_weights = weights.flatten()[order].to(compute)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # the one host read
    out = torch.zeros(x.shape, dtype=compute, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start : start + count]
        y = _mlp(x.index_select(0, rows), w13[expert], w2[expert], act)
        out.index_add_(0, rows, y.to(compute).mul_(pair_weights[start : start + count, None]))
        start += count
    if shared_w13 is not None:
        out += _mlp(x, shared_w13, shared_w2, act).to(compute)
    return out.to(x.dtype)
