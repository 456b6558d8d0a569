"""Every op's input check, for hand-written providers: call it first, and refuse what the reference refuses.

Each ``check_<op>`` takes the op's arguments (same names, same defaults) and raises
``vllm_port.errors.OpInputError`` naming the op, the argument and the fix; it reads only metadata
(dtypes, shapes, devices), never tensor values, so it costs no device synchronisation::

    from vllm_port.ops.checks import check_rms_norm

    def my_rms_norm(x, weight, epsilon):
        check_rms_norm(x, weight, epsilon)
        ...

:data:`INPUT_CHECKS` maps each op's name to its check.
"""

from __future__ import annotations

from collections.abc import Callable

from .activation import check_gelu_and_mul, check_silu_and_mul
from .attention import check_paged_attention, check_prefill_attention, check_reshape_and_cache
from .linear import check_embedding, check_linear
from .norm import check_fused_add_rms_norm, check_rms_norm
from .rotary import check_rotary_embedding
from .sampling import check_sample

__all__ = [
    "INPUT_CHECKS",
    "check_embedding",
    "check_fused_add_rms_norm",
    "check_gelu_and_mul",
    "check_linear",
    "check_paged_attention",
    "check_prefill_attention",
    "check_reshape_and_cache",
    "check_rms_norm",
    "check_rotary_embedding",
    "check_sample",
    "check_silu_and_mul",
]

#: op name -> its input check
INPUT_CHECKS: dict[str, Callable[..., object]] = {
    "embedding": check_embedding,
    "rms_norm": check_rms_norm,
    "fused_add_rms_norm": check_fused_add_rms_norm,
    "linear": check_linear,
    "rotary_embedding": check_rotary_embedding,
    "reshape_and_cache": check_reshape_and_cache,
    "prefill_attention": check_prefill_attention,
    "paged_attention": check_paged_attention,
    "silu_and_mul": check_silu_and_mul,
    "gelu_and_mul": check_gelu_and_mul,
    "sample": check_sample,
}
