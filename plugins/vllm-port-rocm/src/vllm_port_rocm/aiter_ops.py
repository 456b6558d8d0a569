"""Optional AITER providers (AMD's AI Tensor Engine for ROCm, ``pip install vllm-port-rocm[aiter]``).

Registered at priority 30, above the shared Triton kernels (20), only when the ``aiter`` package
imports on a ROCm build of torch; otherwise :func:`providers` returns none and :data:`status` says why.
Nothing here raises at plugin load.

Adapted AITER functions (their signatures as defined in ``aiter/ops/rmsnorm.py`` of ROCm/aiter and
exported from the ``aiter`` package; vLLM's ROCm backend calls them the same way):

* ``aiter.rms_norm(input, weight, epsilon) -> Tensor``: RMSNorm of a 2-D ``input`` over its last dim.
* ``aiter.rmsnorm2d_fwd_with_add(out, input, residual_in, residual_out, weight, epsilon) -> None``:
  writes ``input + residual_in`` to ``residual_out`` and its RMSNorm to ``out``.

Rotary embedding and paged attention are not adapted: their AITER entry points take layouts and
arguments (cos/sin split caches, a ``[num_blocks, kv_heads, head_size/x, block_size, x]`` key cache)
that could not be stated precisely from AITER's documentation, so the Triton kernels keep them.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from vllm_port.ops import Provider
from vllm_port.ops.norm import check_fused_add_rms_norm, check_rms_norm

#: Above the Triton kernels (20): a vendor library's tuned kernels win where they apply.
AITER_PRIORITY = 30
#: AITER's norm kernels are built for half precision and float32.
AITER_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

#: Why AITER providers are or are not registered; set by :func:`providers`.
status = "not checked"


def load_aiter() -> tuple[ModuleType | None, str]:
    """Import ``aiter`` if it can serve here: the module (or ``None``) and a status line.

    Any failure (not installed, not a ROCm build of torch, a broken install) gives ``None``, never an exception.
    """
    if torch.version.hip is None:
        return None, f"not used: torch {torch.__version__} is not a ROCm build"
    try:
        import aiter
    except ImportError:
        return None, "not installed (pip install vllm-port-rocm[aiter])"
    except Exception as exc:  # a broken vendor install must not break discovery
        return None, f"import failed: {type(exc).__name__}: {exc}"
    missing = [fn for fn in ("rms_norm", "rmsnorm2d_fwd_with_add") if not hasattr(aiter, fn)]
    if missing:
        version = getattr(aiter, "__version__", "unknown version")
        return None, f"aiter {version} lacks {', '.join(missing)}; upgrade aiter"
    return aiter, f"aiter {getattr(aiter, '__version__', '(version unknown)')}"


class AiterKernels:
    """Adapters from the contract ops to AITER; each method has exactly the op reference's signature."""

    OPS = ("rms_norm", "fused_add_rms_norm")

    def __init__(self, aiter: Any) -> None:
        self.aiter = aiter

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        check_rms_norm(x, weight, epsilon)
        rows = x.reshape(-1, x.shape[-1])  # AITER's kernel takes [tokens, hidden]
        return self.aiter.rms_norm(rows, weight, epsilon).view(x.shape)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
    ) -> torch.Tensor:
        check_fused_add_rms_norm(x, residual, weight, epsilon)
        rows, res_rows = x.reshape(-1, x.shape[-1]), residual.reshape(-1, residual.shape[-1])
        out = torch.empty_like(rows)
        res_out = torch.empty_like(res_rows)  # a separate buffer: no assumption that AITER allows aliasing
        self.aiter.rmsnorm2d_fwd_with_add(out, rows, res_rows, res_out, weight, epsilon)
        residual.copy_(res_out.view(residual.shape))
        return out.view(x.shape)


def adapters(aiter: Any) -> list[Provider]:
    """The AITER providers over module ``aiter`` (the real one, or a stand-in in tests)."""
    kernels = AiterKernels(aiter)
    return [Provider(op, f"aiter_{op}", getattr(kernels, op), AITER_PRIORITY, AITER_DTYPES) for op in kernels.OPS]


def providers() -> list[Provider]:
    """The AITER providers when ``aiter`` imports on a ROCm build of torch, else none (see :data:`status`)."""
    global status
    aiter, status = load_aiter()
    return adapters(aiter) if aiter is not None else []
