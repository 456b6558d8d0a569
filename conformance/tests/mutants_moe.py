"""Mutants of the mixture-of-experts op: providers of ``fused_moe`` with one bug each.

One platform plugin holds them all (one ``vllm-port certify`` run, its own batch). Each provider is
a correct sort-by-expert implementation but for one realistic bug of the kind MoE kernels have
shipped with (the routing formula of one model family applied to another, a weight applied twice
or not at all, the gate and up halves swapped, ties broken the other way), refused by the op check
on the hand sample that exercises it.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

SOURCE = """
import torch
import torch.nn.functional as F

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.moe import check_fused_moe


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="mutant-moe", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def _route(logits, top_k, scoring, renormalize, scaling, bug):
    logits = logits.float()
    if bug == "ties to the higher index":
        flipped = torch.sort(logits.flip(-1), dim=-1, descending=True, stable=True).indices
        ids = (logits.shape[-1] - 1 - flipped)[:, :top_k]
    else:
        ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if bug == "softmax over the chosen logits":
        weights = torch.softmax(logits.gather(1, ids), dim=-1)
    elif scoring == "softmax" or bug == "sigmoid scored as softmax":
        weights = torch.softmax(logits, dim=-1).gather(1, ids)
    else:
        weights = torch.sigmoid(logits).gather(1, ids)
    if renormalize and bug != "renormalize ignored":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * (1.0 if bug == "routed_scaling ignored" else scaling), ids


def _mlp(x, w13, w2, activation, bug):
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    if bug == "gate and up swapped":
        gate, up = up, gate
    if activation == "silu":
        act = F.silu(gate)
    else:
        approximate = "tanh" if activation == "gelu_tanh" or bug == "gelu always tanh" else "none"
        act = F.gelu(gate, approximate=approximate)
    return F.linear(act * up, w2)


def _moe(x, logits, w13, w2, top_k, scoring, renormalize, activation, scaling, s13, s2, bug):
    check_fused_moe(x, logits, w13, w2, top_k, scoring, renormalize, activation, scaling, s13, s2)
    weights, ids = _route(logits, top_k, scoring, renormalize, scaling, bug)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        y = _mlp(x[token], w13[e], w2[e], activation, bug).float()
        w = torch.ones_like(weights[token, slot]) if bug == "weights not applied" else weights[token, slot]
        out.index_add_(0, token, y * w[:, None])
    if s13 is not None and bug != "shared experts dropped":
        out += _mlp(x, s13, s2, activation, bug).float()
    return out.to(x.dtype)


def _mutant(name, bug):
    def fn(x, router_logits, w13, w2, top_k, scoring="softmax", renormalize=False, activation="silu",
           routed_scaling=1.0, shared_w13=None, shared_w2=None):
        return _moe(x, router_logits, w13, w2, top_k, scoring, renormalize, activation, routed_scaling, shared_w13,
                    shared_w2, bug)
    return Provider("fused_moe", name, fn, dtypes=frozenset({torch.float32}))


BUGS = {
    "renormalize_ignored_fused_moe": "renormalize ignored",
    "topk_softmax_fused_moe": "softmax over the chosen logits",
    "sigmoid_as_softmax_fused_moe": "sigmoid scored as softmax",
    "scaling_ignored_fused_moe": "routed_scaling ignored",
    "shared_dropped_fused_moe": "shared experts dropped",
    "unweighted_fused_moe": "weights not applied",
    "gate_up_swapped_fused_moe": "gate and up swapped",
    "gelu_tanh_fused_moe": "gelu always tanh",
    "ties_high_fused_moe": "ties to the higher index",
}


@hookimpl
def vllm_port_providers():
    return [_mutant(name, bug) for name, bug in BUGS.items()]
"""


def _refused(name: str, bug: str, case: str, *says: str) -> Mutant:
    """A mutant refused by ``fused_moe``'s check against the reference, on ``case`` (float32)."""
    check = f"test_ops::test_provider_matches_reference[fused_moe-{name}-float32]"
    return Mutant(name, bug, bug.split(":")[0], check, (f"case {case!r}", *says))  # class: "routing" or "experts"


GROUPS = [
    MutantGroup(
        "mutant-moe",
        SOURCE,
        (
            _refused("renormalize_ignored_fused_moe", "routing: ignores renormalize (Qwen3-MoE's norm_topk_prob, Mixtral)",
                     "small", "elements off"),
            _refused("topk_softmax_fused_moe",
                     "routing: softmax over the chosen logits only (Mixtral's shortcut applied to a model that does not renormalise)",
                     "one token (decode)", "elements off"),
            _refused("sigmoid_as_softmax_fused_moe", "routing: scores a sigmoid router with softmax",
                     "sigmoid scoring, top-1 (llama-4 style)", "elements off"),
            _refused("scaling_ignored_fused_moe", "routing: drops routed_scaling (DeepSeek's routed_scaling_factor)",
                     "routed_scaling 2.5 with shared experts", "elements off"),
            _refused("shared_dropped_fused_moe", "experts: leaves out the shared experts", "small", "elements off"),
            _refused("unweighted_fused_moe", "experts: sums the experts' outputs without their routing weights",
                     "small", "elements off"),
            _refused("gate_up_swapped_fused_moe", "experts: reads w13's up rows as the gate and the gate rows as up",
                     "small", "elements off"),
            _refused("gelu_tanh_fused_moe", "experts: runs exact-GELU experts with the tanh approximation",
                     "gelu (erf) experts", "elements off"),
            _refused("ties_high_fused_moe", "routing: breaks tied router logits toward the higher expert index",
                     "tied router logits: the lower expert index wins", "elements off"),
        ),
    )
]  # fmt: skip
