"""CPU providers of the contract ops, in torch: vectorised, no Python loop over tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_port.ops import Provider, provider
from vllm_port.ops.activation import check_gated
from vllm_port.ops.norm import check_rms_norm


@provider("rms_norm", name="cpu_rms_norm", priority=10)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    # torch's fused rms_norm kernel accumulates in float32 for half types; round before the weight
    # as the reference (and Llama) does.
    check_rms_norm(x, weight, epsilon)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=epsilon).to(x.dtype) * weight


@provider("silu_and_mul", name="cpu_silu_and_mul", priority=10)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = check_gated("silu_and_mul", x)
    out = F.silu(x[..., :d])
    return out.mul_(x[..., d:])


PROVIDERS: list[Provider] = [rms_norm, silu_and_mul]
