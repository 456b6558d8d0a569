"""vLLM's mixture-of-experts layers on the bound ``fused_moe`` provider.

vLLM 0.32 builds a MoE block from three parts (``FusedMoEFactory``): a router, the routed experts and
a runner. The experts' computation is their quantisation method; the unquantised one
(``UnquantizedFusedMoEMethod``, a CustomOp) is replaced here by :class:`VllmPortMoEMethod`, which
declares itself *monolithic*: the runner then hands it the router logits (``apply_monolithic``)
instead of the experts its router chose, and the whole block (routing, each token's experts' gated
MLPs, the weighted sum) runs on ``fused_moe``, eager and compiled alike. The weights stay as vLLM loaded
them: ``w13 = [gate; up]`` per expert, the contract's layout, never repacked for vLLM's kernels.

vLLM's router is not called, so every setting that would make vLLM route or combine otherwise than the
op is refused by name when the layer is built, never run in silence: grouped top-k, a score correction
bias, a custom routing function, scorings other than softmax and sigmoid, router weights applied to the
input, zero experts, hash routing, a simulated router; activations other than SiLU and GELU (exact or
tanh) with their product, expert biases, clamped SwiGLU; a fused shared-expert gate, transforms around
the routed experts; expert, data or context parallelism, EPLB, LoRA, a ``moe_backend`` named, batch
invariance, a ``routed_scaling_factor`` on the router's weights (vLLM's plain top-k leaves it out). Tensor
parallelism is taken: each rank's experts hold a slice of the intermediate width, ``fused_moe`` gives
that slice's partial sum, and vLLM's runner all-reduces it as it does its own kernels'. Shared experts
the model keeps beside the routed ones (Qwen2-MoE's gated one) stay vLLM's modules, built of the layers the
bridge routes anyway.

The runner (``MoERunner``, a PluggableLayer) is replaced too, only to check the settings it holds; the
method refuses to load weights under a runner it did not check (vLLM's transformers backend has its own).

``VLLM_BRIDGE_KEEP=fused_moe`` leaves every MoE layer on vLLM's own kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import BridgeError
from .runtime import kernels as _kernels
from .runtime import prepare as _prepare

__all__ = ["register_moe"]

#: set on the routed experts by the checked runner; the method loads weights only under one
_CHECKED = "_vllm_port_moe_checked"


def _refusal(what: str) -> BridgeError:
    return BridgeError(
        f"vllm-port bridge: this model has a mixture-of-experts layer with {what}, which fused_moe does not compute "
        "(it routes each token to the top-k experts of its router logits by softmax or sigmoid scores, optionally "
        "renormalised and scaled, and sums their gated SiLU/GELU MLPs); the bridge refuses rather than run vLLM's "
        "kernel in silence. Keep these layers on vLLM's kernels with VLLM_BRIDGE_KEEP=fused_moe, or run the model "
        "without the bridge"
    )


def _activation(value: Any) -> str:
    """vLLM's ``MoEActivation`` (or its name) as ``fused_moe``'s ``activation`` argument."""
    return getattr(value, "value", value)


def _refuse_config(moe: Any) -> None:
    """Refuse what a ``FusedMoEConfig`` asks that ``fused_moe`` does not compute."""
    import vllm.envs as envs

    from vllm_port.ops.moe import MOE_ACTIVATIONS

    activation = _activation(moe.activation)
    if activation not in MOE_ACTIVATIONS:
        raise _refusal(f"the activation {activation!r} (fused_moe takes {', '.join(MOE_ACTIVATIONS)}, gated)")
    for flag, what in (
        ("has_bias", "biases on the experts' projections"),
        ("is_lora_enabled", "LoRA adapters on the experts"),
        ("has_hash_routing", "hash routing"),
    ):
        if getattr(moe, flag):
            raise _refusal(what)
    for knob in ("swiglu_limit", "swiglu_alpha", "swiglu_beta", "activation_situ_beta", "activation_situ_linear_beta"):
        if getattr(moe, knob) is not None:
            raise _refusal(f"{knob}={getattr(moe, knob)!r}")
    if envs.VLLM_BATCH_INVARIANT:
        raise _refusal(
            "VLLM_BATCH_INVARIANT=1 (vLLM then runs batch-invariant MoE kernels; fused_moe promises no batch invariance)"
        )
    if moe.moe_backend != "auto":
        raise _refusal(f"moe_backend {moe.moe_backend!r} (a kernel of vLLM's named)")
    parallel = moe.moe_parallel_config
    for name, value, what in (
        ("use_ep", parallel.use_ep, "expert parallelism"),
        ("dp_size", parallel.dp_size > 1, "data parallelism across the experts"),
        ("pcp_size", parallel.pcp_size > 1, "context parallelism"),
        ("sp_size", parallel.sp_size > 1, "sequence parallelism"),
        ("enable_eplb", parallel.enable_eplb, "expert load balancing (EPLB)"),
    ):
        if value:
            raise _refusal(f"{what} ({name}={getattr(parallel, name)!r})")


def _refuse_routing(runner: Any) -> None:
    """Refuse routing the runner's experts and router would do otherwise than ``fused_moe``."""
    import vllm.envs as envs

    from vllm_port.ops.moe import MOE_SCORINGS

    experts = runner.routed_experts
    method = type(experts.quant_method).__name__
    if method != "VllmPortMoEMethod":  # a quantised method (FP8, int4...): vLLM's kernels would run it
        raise _refusal(f"quantised experts ({method})")
    if envs.VLLM_MOE_ROUTING_SIMULATION_STRATEGY:
        raise _refusal(
            f"a simulated router (VLLM_MOE_ROUTING_SIMULATION_STRATEGY={envs.VLLM_MOE_ROUTING_SIMULATION_STRATEGY!r})"
        )
    if type(runner.router).__name__ == "ZeroExpertRouter":
        raise _refusal("zero experts (zero_expert_type)")
    if experts.scoring_func not in MOE_SCORINGS:
        raise _refusal(f"scoring_func {experts.scoring_func!r} (fused_moe scores by {' or '.join(MOE_SCORINGS)})")
    if experts.routed_scaling_factor != 1.0:  # vLLM's plain top-k routers leave it out; only the refused ones apply it
        raise _refusal(
            f"routed_scaling_factor={experts.routed_scaling_factor!r} on the router's weights, which vLLM's own "
            "plain top-k routing does not apply"
        )
    for attribute, what in (
        ("use_grouped_topk", "grouped top-k routing"),
        ("custom_routing_function", "a custom routing function"),
        ("e_score_correction_bias", "a score correction bias"),
        ("apply_router_weight_on_input", "router weights applied to the input"),
    ):
        value = getattr(experts, attribute)
        if value is not None and value is not False:
            raise _refusal(what)
    for attribute, what in (
        ("routed_input_transform", "a transform of the routed experts' input"),
        ("routed_output_transform", "a transform of the routed experts' output"),
    ):
        if getattr(runner, attribute) is not None:
            raise _refusal(what)
    if experts.expert_map_manager.num_fused_shared_experts:
        raise _refusal("shared experts fused into the routed ones (fuse_shared_experts)")
    if runner.gate is not None and runner.shared_expert_gate is not None:
        raise _refusal("a shared-expert gate fused into the router")
    if runner.enable_dbo:
        raise _refusal("dual-batch overlap (enable_dbo)")


def _method_class() -> type:
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    class VllmPortMoEMethod(UnquantizedFusedMoEMethod):
        """vLLM's unquantised MoE method over the bound ``fused_moe`` provider: router logits in, block out."""

        def __init__(self, moe: Any) -> None:
            FusedMoEMethodBase.__init__(self, moe)  # not vLLM's backend choice: nothing of vLLM's kernels runs
            _refuse_config(moe)
            self.unquantized_backend = UnquantizedMoeBackend.OOT  # vLLM pads and repacks nothing for it
            self.experts_cls = None
            self.supports_pre_processed_weights = True
            _prepare(moe.in_dtype, ("fused_moe",))

        @property
        def is_monolithic(self) -> bool:
            return True  # the runner hands over the router logits, not its router's choice

        @property
        def supports_eplb(self) -> bool:
            return False

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            if not getattr(layer, _CHECKED, False):
                raise BridgeError(
                    f"vllm-port bridge: the mixture-of-experts layer {getattr(layer, 'layer_name', '?')} was built by "
                    "a runner the bridge does not check (not vLLM's MoERunner), so its routing settings are unknown; "
                    "keep MoE layers on vLLM's kernels with VLLM_BRIDGE_KEEP=fused_moe"
                )
            if self.moe._defer_moe_finalize:
                raise _refusal("a deferred finalize of the experts' output")

        def apply_monolithic(
            self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None
        ) -> torch.Tensor:
            return _kernels(x.dtype).fused_moe(
                x,
                router_logits,
                layer.w13_weight,
                layer.w2_weight,
                layer.top_k,
                layer.scoring_func,
                bool(layer.renormalize),
                _activation(layer.activation),
                1.0,  # any other factor is refused when the layer is built (_refuse_routing)
            )

        def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise BridgeError(
                "vllm-port bridge: vLLM called the MoE method with experts its router chose (the modular path), "
                "but the bridge's method computes from the router logits (monolithic); this vLLM routes MoE "
                "differently from the 0.32 the bridge knows. Keep MoE layers on vLLM's kernels with "
                "VLLM_BRIDGE_KEEP=fused_moe"
            )

    return VllmPortMoEMethod


def _runner_class() -> type:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    class VllmPortMoERunner(MoERunner):
        """vLLM's MoE runner, checked for settings ``fused_moe`` does not compute when it is built."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _refuse_routing(self)
            setattr(self.routed_experts, _CHECKED, True)

    return VllmPortMoERunner


def register_moe() -> list[str]:
    """Register the bridge's MoE method and runner with vLLM (``register_oot``); return the class names replaced.

    Once per process; a second call registers nothing.
    """
    from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot

    made = {"UnquantizedFusedMoEMethod": (CustomOp, _method_class()), "MoERunner": (PluggableLayer, _runner_class())}
    for name, (kind, cls) in made.items():
        if name not in op_registry_oot:
            kind.register_oot(cls, name=name)
    return sorted(made)
