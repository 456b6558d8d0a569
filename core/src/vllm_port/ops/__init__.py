"""The contract ops: each a reference implementation in plain torch, with providers bound per platform.

Plugins register providers through the ``vllm_port_providers`` hook; engines call the bound ones::

    runtime = vllm_port.load()
    kernels = runtime.bind(torch.bfloat16)
    y = kernels.rms_norm(x, weight, 1e-6)

A hand-written provider calls its op's input check first (``vllm_port.ops.checks``, also exported
here: ``check_rms_norm`` and the like), so it refuses exactly what the reference refuses.
"""

from __future__ import annotations

from ._op import ErrorInput, IndexedTable, Op, SampleInput, Tolerance, Variants
from ._provider import FLOAT_DTYPES, REFERENCE, BindContext, Provider, provider
from ._registry import BoundOps, OpRegistry
from .activation import gelu_and_mul, silu_and_mul
from .attention import paged_attention, prefill_attention, reshape_and_cache
from .checks import (
    INPUT_CHECKS,
    check_embedding,
    check_fp8_linear,
    check_fused_add_rms_norm,
    check_fused_moe,
    check_gelu_and_mul,
    check_linear,
    check_paged_attention,
    check_paged_attention_fp8,
    check_prefill_attention,
    check_prefill_attention_fp8,
    check_process_logits,
    check_reshape_and_cache,
    check_reshape_and_cache_fp8,
    check_rms_norm,
    check_rotary_embedding,
    check_sample,
    check_silu_and_mul,
    check_top_logprobs,
)
from .fp8 import fp8_linear
from .kv_fp8 import paged_attention_fp8, prefill_attention_fp8, reshape_and_cache_fp8
from .linear import embedding, linear
from .logits import process_logits, top_logprobs
from .moe import fused_moe
from .norm import fused_add_rms_norm, rms_norm
from .rotary import make_cos_sin_cache, rotary_embedding
from .sampling import sample

#: Every op of the contract, in the order a Llama forward pass meets them (a MoE layer's experts in place of
#: the MLP; logits processed, a token drawn, its logprobs).
ALL_OPS: tuple[Op, ...] = (
    embedding,
    rms_norm,
    fused_add_rms_norm,
    linear,
    fp8_linear,
    rotary_embedding,
    reshape_and_cache,
    prefill_attention,
    paged_attention,
    reshape_and_cache_fp8,
    prefill_attention_fp8,
    paged_attention_fp8,
    silu_and_mul,
    gelu_and_mul,
    fused_moe,
    process_logits,
    sample,
    top_logprobs,
)

__all__ = [
    "ALL_OPS",
    "FLOAT_DTYPES",
    "INPUT_CHECKS",
    "REFERENCE",
    "BindContext",
    "BoundOps",
    "ErrorInput",
    "IndexedTable",
    "Op",
    "OpRegistry",
    "Provider",
    "SampleInput",
    "Tolerance",
    "Variants",
    "check_embedding",
    "check_fp8_linear",
    "check_fused_add_rms_norm",
    "check_fused_moe",
    "check_gelu_and_mul",
    "check_linear",
    "check_paged_attention",
    "check_paged_attention_fp8",
    "check_prefill_attention",
    "check_prefill_attention_fp8",
    "check_process_logits",
    "check_reshape_and_cache",
    "check_reshape_and_cache_fp8",
    "check_rms_norm",
    "check_rotary_embedding",
    "check_sample",
    "check_silu_and_mul",
    "check_top_logprobs",
    "embedding",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "gelu_and_mul",
    "linear",
    "make_cos_sin_cache",
    "paged_attention",
    "paged_attention_fp8",
    "prefill_attention",
    "prefill_attention_fp8",
    "process_logits",
    "provider",
    "reshape_and_cache",
    "reshape_and_cache_fp8",
    "rms_norm",
    "rotary_embedding",
    "sample",
    "silu_and_mul",
    "top_logprobs",
]
