"""Every op's input check, for hand-written providers: call it first, and refuse what the reference refuses.

Each ``check_<op>`` takes the op's arguments (same names, same defaults) and raises
``vllm_port.errors.OpInputError`` (a ``ValueError``) naming the op, the argument, the value and the
fix::

    from vllm_port.ops.checks import check_rms_norm

    def my_rms_norm(x, weight, epsilon):
        check_rms_norm(x, weight, epsilon)
        ...

:data:`INPUT_CHECKS` maps each op's name to its check.

**What is checked when.** Every check has two parts.

- *Structural*, on every call: argument types, dtypes, one device for all tensors, ranks and shapes,
  head sizes (any size >= 1 the cache holds), GQA divisibility, no empty cache dimension, in-place
  arguments that are not expanded views, and the Python scalars (epsilon, scale, window, soft cap,
  max_query_len). These read metadata only: nanoseconds to a microsecond, no device
  synchronisation, so a provider on an accelerator may run them inside a captured step.
- *Values*, only while validation is on (:func:`validation` or ``VLLM_PORT_VALIDATE=1``):
  token ids within the embedding's rows, positions within the rotary cache, slots -1 or within the
  caches (and no two tokens writing one slot), seq_lens within their block-table row's capacity and
  >= 0, the block-table entries a sequence reads within the caches' blocks, ``cu_seqlens_q``
  starting at 0, non-decreasing, ending at ``query``'s token count, every query length within
  ``max_query_len`` and its sequence's length, temperatures finite and >= 0, top_p in (0, 1], no NaN
  logit, penalties finite (repetition > 0), min_p in [0, 1], biases finite or -inf, counts >= 0,
  logprob token ids within the vocabulary, no NaN router logit. Reading a tensor's values on an accelerator waits for the device (and is illegal under
  CUDA/HIP graph capture), and even on the CPU these checks cost a few to tens of microseconds per
  call, repeated by every layer of a step; the engine builds these tensors itself, so in
  production they are trusted, and a bad one is found by turning validation on. Conformance
  certifies under validation (every sample must pass it, every ``Op.value_errors`` input must be
  refused), and so does the fuzz suite (``core/tests/fuzz``). Under graph capture or torch.compile
  tracing, the value checks are skipped even when validation is on.

Without validation an out-of-range value is outside the contract: a provider may raise an
``IndexError`` from torch, read another sequence's cache, or return garbage (see docs/ops.md).
"""

from __future__ import annotations

from collections.abc import Callable

from ._checks import VALIDATE_ENV, validation, validation_enabled
from .activation import check_gelu_and_mul, check_silu_and_mul
from .attention import check_paged_attention, check_prefill_attention, check_reshape_and_cache
from .fp8 import check_fp8_linear
from .kv_fp8 import check_paged_attention_fp8, check_prefill_attention_fp8, check_reshape_and_cache_fp8
from .linear import check_embedding, check_linear
from .logits import check_process_logits, check_top_logprobs
from .moe import check_fused_moe
from .norm import check_fused_add_rms_norm, check_rms_norm
from .rotary import check_rotary_embedding
from .sampling import check_sample

__all__ = [
    "INPUT_CHECKS",
    "VALIDATE_ENV",
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
    "validation",
    "validation_enabled",
]

#: op name -> its input check
INPUT_CHECKS: dict[str, Callable[..., object]] = {
    "embedding": check_embedding,
    "rms_norm": check_rms_norm,
    "fused_add_rms_norm": check_fused_add_rms_norm,
    "linear": check_linear,
    "fp8_linear": check_fp8_linear,
    "rotary_embedding": check_rotary_embedding,
    "reshape_and_cache": check_reshape_and_cache,
    "prefill_attention": check_prefill_attention,
    "paged_attention": check_paged_attention,
    "reshape_and_cache_fp8": check_reshape_and_cache_fp8,
    "prefill_attention_fp8": check_prefill_attention_fp8,
    "paged_attention_fp8": check_paged_attention_fp8,
    "silu_and_mul": check_silu_and_mul,
    "gelu_and_mul": check_gelu_and_mul,
    "fused_moe": check_fused_moe,
    "process_logits": check_process_logits,
    "sample": check_sample,
    "top_logprobs": check_top_logprobs,
}
