"""Optional IPEX providers (intel-extension-for-pytorch, ``pip install vllm-port-xpu[ipex]``).

IPEX is built against one torch minor release (IPEX 2.8.x for torch 2.8.x) and fails or misbehaves
against any other, so its providers are registered (priority 30, above the Triton kernels' 20) only
when its ``major.minor`` equals torch's; otherwise :data:`status` holds a message saying which
versions to install, and the probe reports it as capability ``"ipex"``. Nothing here raises at
plugin load; IPEX is imported only after the version check passes, on a torch build with XPU.

Adapted IPEX functions, from the ``ipex.llm.functional`` API reference (IPEX's LLM "functional"
API doc; vLLM's XPU backend calls them the same way):

* ``rms_norm(hidden_states, weight, eps) -> Tensor``.
* ``add_rms_norm(residual, x, weight, bias, eps, add_back) -> Tensor``: RMSNorm of ``x + residual``
  (plus ``bias``); ``add_back=True`` stores ``x + residual`` into ``residual``.
* ``rotary_embedding(query, key, sin, cos, rotary_dim, rotary_half, position_ids=None)``:
  ``[num_tokens, heads, head_dim]`` query/key, ``rotary_half`` True for NeoX (rotate-half) pairing;
  returns query and key.

KV-cache writes and paged attention are not adapted: IPEX documents
``ipex.llm.modules.PagedAttention`` with a ``[num_blocks, num_heads, block_size, head_size]`` cache,
not the contract's ``[num_blocks, block_size, num_kv_heads, head_size]``, so the Triton kernels keep them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from typing import Any

import torch

from vllm_port.ops import FLOAT_DTYPES, Provider
from vllm_port.ops.norm import check_fused_add_rms_norm, check_rms_norm
from vllm_port.ops.rotary import check_rotary_embedding

DISTRIBUTION = "intel-extension-for-pytorch"
#: Above the Triton kernels (20).
IPEX_PRIORITY = 30
_RELEASE = re.compile(r"\s*v?(\d+)\.(\d+)")

#: Why IPEX providers are or are not registered; set by :func:`providers`.
status = "not checked"


def major_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string, ignoring patch, pre-release and local labels.

    ``"2.8.10+xpu"`` -> ``(2, 8)``; ``"2.13.0.dev20260101+xpu"`` -> ``(2, 13)``; ``"unknown"`` -> ``None``.
    """
    m = _RELEASE.match(version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_mismatch(ipex_version: str, torch_version: str) -> str | None:
    """``None`` when IPEX's major.minor equals torch's, else a message naming the versions to install."""
    ipex, torch_mm = major_minor(ipex_version), major_minor(torch_version)
    if ipex is None or torch_mm is None:
        return f"cannot compare {DISTRIBUTION} {ipex_version!r} with torch {torch_version!r}: not a version"
    if ipex == torch_mm:
        return None
    return (
        f"{ipex_version} does not match torch {torch_version}; install {DISTRIBUTION}=="
        f"{torch_mm[0]}.{torch_mm[1]}.* (IPEX is built for one torch minor release), "
        f"or torch=={ipex[0]}.{ipex[1]}.* to keep this IPEX"
    )


def installed_version() -> str | None:
    """The installed IPEX version, read from its metadata without importing it; ``None`` when absent."""
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return None
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check() -> tuple[bool, str]:
    """Whether IPEX may be used with this torch, and the status line (the probe's ``"ipex"`` capability)."""
    version = installed_version()
    if version is None:
        return False, "not installed (pip install vllm-port-xpu[ipex])"
    mismatch = version_mismatch(version, torch.__version__)
    if mismatch is not None:
        return False, mismatch
    return True, version


class IpexKernels:
    """Adapters from the contract ops to ``ipex.llm.functional``; each method has the op reference's signature."""

    OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding")

    def __init__(self, functional: Any) -> None:
        self.functional = functional

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        check_rms_norm(x, weight, epsilon)
        return self.functional.rms_norm(x, weight, epsilon)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
    ) -> torch.Tensor:
        check_fused_add_rms_norm(x, residual, weight, epsilon)
        # add_back=True: IPEX writes x + residual into residual, as the contract requires.
        return self.functional.add_rms_norm(residual, x, weight, None, epsilon, True)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> None:
        check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
        rot = cos_sin_cache.shape[-1]
        q = query.unflatten(-1, (-1, head_size)) if query.dim() == 2 else query  # views: writes reach query
        k = key.unflatten(-1, (-1, head_size)) if key.dim() == 2 else key
        q_rot, k_rot = q[..., :rot], k[..., :rot]
        cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [tokens, rot / 2] each
        if is_neox:  # IPEX takes a full rotary_dim of cos/sin per token, laid out like the features it rotates
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        else:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        cos, sin = cos.unsqueeze(-2).to(query.dtype), sin.unsqueeze(-2).to(query.dtype)  # [tokens, 1, rot]
        q_out, k_out = self.functional.rotary_embedding(q_rot, k_rot, sin, cos, rot, is_neox, positions)
        # IPEX rotates in place on XPU; copying back covers a build that returns new tensors instead.
        for dst, src in ((q_rot, q_out), (k_rot, k_out)):
            if src is not None and src.data_ptr() != dst.data_ptr():
                dst.copy_(src)


def adapters(functional: Any) -> list[Provider]:
    """The IPEX providers over ``ipex.llm.functional`` (the real one, or a stand-in in tests)."""
    kernels = IpexKernels(functional)
    return [Provider(op, f"ipex_{op}", getattr(kernels, op), IPEX_PRIORITY, FLOAT_DTYPES) for op in kernels.OPS]


def providers() -> list[Provider]:
    """The IPEX providers when a matching IPEX imports on an XPU build of torch, else none (see :data:`status`)."""
    global status
    ok, status = check()
    if not ok:
        return []
    if getattr(torch.version, "xpu", None) is None:
        status = f"{DISTRIBUTION} {status} not used: torch {torch.__version__} has no XPU support"
        return []
    try:
        import intel_extension_for_pytorch as ipex
    except Exception as exc:  # a broken vendor install must not break discovery
        status = f"{DISTRIBUTION} {status} failed to import: {type(exc).__name__}: {exc}"
        return []
    functional = getattr(getattr(ipex, "llm", None), "functional", None)
    missing = [fn for fn in ("rms_norm", "add_rms_norm", "rotary_embedding") if not hasattr(functional, fn)]
    if missing:
        status = f"{DISTRIBUTION} {status} lacks ipex.llm.functional.{', '.join(missing)}"
        return []
    return adapters(functional)
