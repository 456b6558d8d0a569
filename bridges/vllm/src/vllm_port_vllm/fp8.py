"""vLLM's FP8 linear layers on the bound ``fp8_linear`` provider.

vLLM picks the kernel of an FP8 linear layer from a list per platform (``register_linear_kernel``,
``kernel_type="fp8"``): the first class whose ``is_supported`` and ``can_implement`` accept the
layer's configuration. The bridge puts :class:`VllmPortFp8Kernel` at the head of the current
platform's list, so every FP8 layer vLLM builds with per-tensor or per-channel e4m3 weights comes
here: checkpoints in vLLM's own ``fp8`` format and compressed-tensors' ``float-quantized`` ones alike.

``fp8_linear`` quantises each token's activations on the fly (one scale per token, e4m3), as the
checkpoints that say "dynamic, per token" ask (compressed-tensors' FP8-dynamic). A layer that asks
for anything else is refused by name, not run on vLLM's kernel in silence:

- activations with a static scale from the checkpoint (``input_scale``) or one dynamic scale for the
  whole batch: the contract op would compute another quantisation than the one the model was
  calibrated for;
- weights in 128 x 128 blocks (DeepSeek-V3 and transformers' FineGrainedFP8): vLLM routes those
  through its block-scaled kernels, a list the bridge does not reach (``docs/vllm-bridge.md``);
- an output dtype other than the activations'.

``VLLM_BRIDGE_KEEP=fp8_linear`` leaves every FP8 layer on vLLM's own kernels instead.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BridgeError
from .runtime import ON_DEMAND_OPS
from .runtime import kernels as _kernels
from .runtime import prepare as _prepare

__all__ = ["register_fp8"]


def _refusal(what: str) -> BridgeError:
    return BridgeError(
        f"vllm-port bridge: this model has an FP8 linear layer with {what}, which fp8_linear does not compute "
        "(it takes e4m3 weights with one scale per tensor or per output channel and quantises each token's "
        "activations on the fly); the bridge refuses rather than run vLLM's kernel in silence. Run vLLM's own "
        "FP8 kernels for these layers with VLLM_BRIDGE_KEEP=fp8_linear, or the model without the bridge"
    )


def _granularity(group_shape: Any) -> str:
    for kind in ("tensor", "token", "channel"):
        if getattr(group_shape, f"is_per_{kind}")():
            return f"per {kind}"
    return f"per group of {tuple(group_shape)}"


def _kernel_class() -> type:
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearKernel

    class VllmPortFp8Kernel(FP8ScaledMMLinearKernel):
        """vLLM's FP8 linear kernel interface over the bound ``fp8_linear`` provider."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None  # wherever the bridge runs: the plugin's provider is what runs

        @classmethod
        def can_implement(cls, c: Any) -> tuple[bool, str | None]:
            weights, activations = c.weight_quant_key.scale, c.activation_quant_key.scale
            if not (weights.group_shape.is_per_tensor() or weights.group_shape.is_per_channel()):
                raise _refusal(f"weight scales {_granularity(weights.group_shape)}")
            if activations.static:
                raise _refusal(
                    f"static activation scales {_granularity(activations.group_shape)} (from the checkpoint)"
                )
            if not activations.group_shape.is_per_token():
                raise _refusal(f"dynamic activation scales {_granularity(activations.group_shape)}")
            if c.out_dtype is not None and c.out_dtype != c.input_dtype:
                raise _refusal(f"{c.input_dtype} activations and {c.out_dtype} outputs")
            return True, None

        def __init__(self, c: Any, layer_param_names: Any) -> None:
            super().__init__(c, layer_param_names)
            _prepare(c.input_dtype, ON_DEMAND_OPS)  # fp8_linear, smoke-checked

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass  # vLLM's scheme already stored the weight as [in_features, out_features], which the op reads as a view

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
            weight, scale, _, _ = self._get_layer_params(layer)
            scale = scale.reshape(-1) if scale.numel() > 1 else scale.reshape(())  # [out] or per tensor
            return _kernels(x.dtype).fp8_linear(x, weight.t(), scale, bias)

        def apply_scaled_mm(self, **_: Any) -> torch.Tensor:
            raise NotImplementedError("VllmPortFp8Kernel computes in apply_weights; nothing calls apply_scaled_mm")

    return VllmPortFp8Kernel


def register_fp8() -> list[str]:
    """Put the bridge's FP8 kernel first in vLLM's list for the current platform; return the kernel's name.

    Once per process; a second call changes nothing.
    """
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    platform = current_platform._enum
    if not isinstance(getattr(linear, "_POSSIBLE_FP8_KERNELS", None), dict):
        raise BridgeError(
            "vllm-port bridge: this vLLM has no vllm.model_executor.kernels.linear._POSSIBLE_FP8_KERNELS, the list "
            "its FP8 linear layers choose a kernel from; the bridge refuses rather than leave them on vLLM's kernels"
        )
    if any(k.__name__ == "VllmPortFp8Kernel" for k in linear._POSSIBLE_FP8_KERNELS.get(platform, [])):
        return ["VllmPortFp8Kernel"]
    kernel = _kernel_class()
    linear.register_linear_kernel(kernel, platform, "fp8")  # appends; vLLM takes the first that accepts a layer
    chosen = linear._POSSIBLE_FP8_KERNELS[platform]
    chosen.insert(0, chosen.pop())
    return [kernel.__name__]
