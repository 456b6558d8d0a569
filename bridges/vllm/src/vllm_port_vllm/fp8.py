"""vLLM's FP8 linear layers on the bound ``fp8_linear`` provider.

vLLM picks the kernel of an FP8 linear layer from a list per platform (``register_linear_kernel``,
``kernel_type="fp8"``): the first class whose ``is_supported`` and ``can_implement`` accept the
layer's configuration. The bridge puts :class:`VllmPortFp8Kernel` at the head of the current
platform's list, so the FP8 layers vLLM builds through that list come here: e4m3 weights with one
scale per tensor or per output channel (vLLM's ``fp8`` format, compressed-tensors' ``float-quantized``,
ModelOpt's and FBGEMM's per-channel ones), activations quantised on the fly.

``fp8_linear`` quantises each token's activations (or computes the exact product), which is at least as
accurate as any dynamic scheme vLLM would run for the layer (one scale per token, or one for the batch
where the platform lacks per-token kernels). A layer that asks for anything else is refused by name, not
run on vLLM's kernel in silence: activations with a static scale from the checkpoint (``input_scale``),
an upper bound on the activations' scale (FBGEMM's ``input_scale_ub``), an output dtype other than the
activations'.

vLLM 0.32 chooses the kernel of the FP8 linear schemes this module knows (``fp8_w8a8``: per tensor or
channel; ``fp8_block_w8a8``: weights in blocks; ``w8a16_fp8``: weight-only) through one function,
``choose_scaled_mm_linear_kernel``; the bridge wraps it, so a layer of those schemes that would get any
kernel but this one is refused when vLLM builds it, naming why: weights in 128 x 128 blocks (their own
kernel list), compressed-tensors FP8 run weight-only (XPU, CUDA before sm_89), a ``--linear-backend`` (or
``linear_backend_per_quant``) naming one of vLLM's kernels, ``VLLM_DISABLED_KERNELS=VllmPortFp8Kernel``, a
kernel vLLM forces. vLLM's ``VLLM_BATCH_INVARIANT`` mode is refused as well: its ``fp8`` format then
dequantises to bf16 around any kernel, and ``fp8_linear`` promises no batch invariance. MXFP8 layers choose
their kernel elsewhere (``init_mxfp8_linear_kernel``) and stay vLLM's, as every quantisation the bridge does
not route.

``VLLM_BRIDGE_KEEP=fp8_linear`` leaves every FP8 layer on vLLM's own kernels instead.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BridgeError
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


def _bypass(why: str) -> BridgeError:
    return BridgeError(
        f"vllm-port bridge: vLLM would run an FP8 linear layer on its own kernel, not on the plugin's fp8_linear, "
        f"because of {why}; the bridge refuses rather than run vLLM's kernel in silence. Drop that setting, or keep "
        "the FP8 layers on vLLM's kernels with VLLM_BRIDGE_KEEP=fp8_linear"
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
            shape = weights.group_shape  # of the [out, in] weight: one per output row is "per token" in vLLM's words
            if not (shape.is_per_tensor() or shape.is_per_channel() or shape.is_per_token()):
                raise _refusal(f"weight scales {_granularity(shape)}")
            if c.weight_quant_key.dtype != torch.float8_e4m3fn:
                raise _refusal(f"{c.weight_quant_key.dtype} weights (fp8_linear takes float8_e4m3fn)")
            if activations.static:
                raise _refusal(
                    f"static activation scales {_granularity(activations.group_shape)} (from the checkpoint)"
                )
            if c.out_dtype is not None and c.out_dtype != c.input_dtype:
                raise _refusal(f"{c.input_dtype} activations and {c.out_dtype} outputs")
            return True, None

        def __init__(self, c: Any, layer_param_names: Any) -> None:
            import vllm.envs as envs

            if envs.VLLM_BATCH_INVARIANT:
                raise _bypass(
                    "VLLM_BATCH_INVARIANT=1 (vLLM then dequantises its fp8 format around any kernel, and fp8_linear "
                    "promises no batch invariance)"
                )
            super().__init__(c, layer_param_names)
            _prepare(c.input_dtype, ("fp8_linear",))  # smoke-checked when vLLM builds the first FP8 layer

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass  # vLLM's scheme already stored the weight as [in_features, out_features], which the op reads as a view

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
            weight, scale, _, bound = self._get_layer_params(layer)
            if bound is not None:
                raise _refusal("an upper bound on the activations' scale (input_scale_ub)")
            scale = scale.reshape(-1) if scale.numel() > 1 else scale.reshape(())  # [out] or per tensor
            return _kernels(x.dtype).fp8_linear(x, weight.t(), scale, bias)

        def apply_scaled_mm(self, **_: Any) -> torch.Tensor:
            raise NotImplementedError("VllmPortFp8Kernel computes in apply_weights; nothing calls apply_scaled_mm")

    return VllmPortFp8Kernel


#: vLLM's names for the FP8 linear schemes (``quantization=`` of its kernel choice), and what each asks for
#: that fp8_linear does not take when the bridge's kernel is not in its list
_FP8_SCHEMES = {
    "fp8_w8a8": None,  # the list the bridge heads
    "fp8_block_w8a8": "weights in blocks (vLLM's block-scaled kernels take activations quantised per group)",
    "w8a16_fp8": "FP8 weights only (vLLM runs this layer weight-only, activations unquantised)",
}


def _not_chosen(linear: Any, scheme: str, kernel: type, force_kernel: type | None) -> BridgeError:
    """The refusal of a layer of ``scheme`` that vLLM gave ``kernel``, not the bridge's, naming why."""
    import vllm.envs as envs

    if (what := _FP8_SCHEMES[scheme]) is not None:
        return _refusal(what)
    if "VllmPortFp8Kernel" in envs.VLLM_DISABLED_KERNELS:
        return _bypass("VLLM_DISABLED_KERNELS naming VllmPortFp8Kernel")
    if (backend := linear._get_linear_backend(quantization=scheme)) != "auto":
        return _bypass(f"the linear backend {backend!r} (--linear-backend or linear_backend_per_quant)")
    if force_kernel is not None:
        return _bypass(f"vLLM forcing its {force_kernel.__name__}")
    return _bypass(f"vLLM choosing its {kernel.__name__}")


def _guard_kernel_choice(linear: Any) -> None:
    """Make every FP8 linear layer's kernel choice refuse any kernel but the bridge's (once per process)."""
    choose = linear.choose_scaled_mm_linear_kernel
    if getattr(choose, "__vllm_port_guard__", False):
        return

    def choose_guarded(
        config: Any,
        possible_kernels: Any,
        compute_capability: Any = None,
        force_kernel: Any = None,
        *,
        quantization: str,
    ) -> type:
        kernel = choose(config, possible_kernels, compute_capability, force_kernel, quantization=quantization)
        if quantization in _FP8_SCHEMES and kernel.__name__ != "VllmPortFp8Kernel":
            raise _not_chosen(linear, quantization, kernel, force_kernel)
        return kernel

    choose_guarded.__vllm_port_guard__ = True  # type: ignore[attr-defined]
    choose_guarded.__wrapped__ = choose  # type: ignore[attr-defined]
    linear.choose_scaled_mm_linear_kernel = choose_guarded  # vLLM's callers look it up in the module at each call


def register_fp8() -> list[str]:
    """Put the bridge's FP8 kernel first in vLLM's list for the current platform, and make a layer that would get
    any other FP8 linear kernel refuse; return the kernel's name.

    Once per process; a second call changes nothing.
    """
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    platform = current_platform._enum
    if not isinstance(getattr(linear, "_POSSIBLE_FP8_KERNELS", None), dict):  # the functions: compat.py watches them
        raise BridgeError(
            "vllm-port bridge: this vLLM has no vllm.model_executor.kernels.linear._POSSIBLE_FP8_KERNELS, the list "
            "its FP8 linear layers choose a kernel from; the bridge refuses rather than leave them on vLLM's kernels"
        )
    _guard_kernel_choice(linear)
    if any(k.__name__ == "VllmPortFp8Kernel" for k in linear._POSSIBLE_FP8_KERNELS.get(platform, [])):
        return ["VllmPortFp8Kernel"]
    kernel = _kernel_class()
    linear.register_linear_kernel(kernel, platform, "fp8")  # appends; vLLM takes the first that accepts a layer
    chosen = linear._POSSIBLE_FP8_KERNELS[platform]
    chosen.insert(0, chosen.pop())
    return [kernel.__name__]
