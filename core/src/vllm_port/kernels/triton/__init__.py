"""Triton kernels for the contract ops, written once and shared by the GPU plugins.

Each module holds the kernels of a family of ops and a class whose methods are the providers
(a bound method's signature is exactly the op reference's, so registration checks it like any
other). ``providers(target, priority)`` gives a plugin every Triton provider configured for its
hardware, by the :class:`TritonTarget` the plugin keeps (``vllm_port_cuda.triton_targets``...;
the type lives in :mod:`vllm_port.kernels.triton_target`, re-exported here); a class with a
``supports(ctx)`` method gives its providers that bind-time predicate.
``swap_blocks`` (``swap.py``) is no op's provider: the migrator's one-launch block copy between tiers.
Importing this package imports ``triton``.
"""

from __future__ import annotations

from ...ops import FLOAT_DTYPES, Provider
from ..triton_target import INTERPRETER, LinearTiles, MatmulTiles, MoeTiles, TritonTarget
from .swap import swap_blocks

__all__ = [
    "INTERPRETER",
    "LinearTiles",
    "MatmulTiles",
    "MoeTiles",
    "TritonTarget",
    "kernel_classes",
    "providers",
    "swap_blocks",
]


def kernel_classes() -> list[type]:
    """The kernel classes; each has ``OPS`` (the op names it serves) and takes a ``TritonTarget``."""
    from .activation import ActivationKernels
    from .attention import AttentionKernels
    from .cache import CacheKernels
    from .fp8_linear import Fp8LinearKernels
    from .kv_fp8 import Fp8CacheKernels
    from .linear import LinearKernels
    from .logits import LogitsKernels
    from .moe import MoeKernels
    from .norm import NormKernels
    from .rotary import RotaryKernels
    from .sampling import SamplingKernels

    return [
        NormKernels,
        ActivationKernels,
        RotaryKernels,
        CacheKernels,
        AttentionKernels,
        SamplingKernels,
        LogitsKernels,
        LinearKernels,
        MoeKernels,
        Fp8LinearKernels,
        Fp8CacheKernels,
    ]


def providers(target: TritonTarget, priority: int = 20) -> list[Provider]:
    """Every Triton provider launched with ``target``'s configuration, named ``triton_<op>``."""
    found: list[Provider] = []
    for cls in kernel_classes():
        kernels = cls(target)
        supports = getattr(kernels, "supports", None)
        found += [
            Provider(op, f"triton_{op}", getattr(kernels, op), priority, FLOAT_DTYPES, supports) for op in cls.OPS
        ]
    return found
