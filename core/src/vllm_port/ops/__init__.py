"""The contract ops: each a reference implementation in plain torch, with providers bound per platform.

Plugins register providers through the ``vllm_port_providers`` hook; engines call the bound ones::

    runtime = vllm_port.load()
    kernels = runtime.bind(torch.bfloat16)
    y = kernels.rms_norm(x, weight, 1e-6)
"""

from __future__ import annotations

from ._op import ErrorInput, Op, SampleInput, Tolerance, compare
from ._registry import FLOAT_DTYPES, REFERENCE, BindContext, BoundOps, OpRegistry, Provider, provider
from .activation import silu_and_mul
from .norm import rms_norm

#: Every op of the contract, in the order ``doctor`` lists them.
ALL_OPS: tuple[Op, ...] = (rms_norm, silu_and_mul)

__all__ = [
    "ALL_OPS",
    "FLOAT_DTYPES",
    "REFERENCE",
    "BindContext",
    "BoundOps",
    "ErrorInput",
    "Op",
    "OpRegistry",
    "Provider",
    "SampleInput",
    "Tolerance",
    "compare",
    "provider",
    "rms_norm",
    "silu_and_mul",
]
