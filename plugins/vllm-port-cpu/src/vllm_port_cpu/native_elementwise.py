"""Native fused element-wise providers for the CPU plugin: rms_norm, fused_add_rms_norm, silu_and_mul, rotary_embedding.

The torch providers (:mod:`.ops`) run each of these as three to eight torch calls, each a pass over
memory and a dispatch of a few microseconds; at decode's few rows the dispatches are most of the
time. ``csrc/elementwise.c`` (built into :mod:`.native`'s library, with its build, cache and
fallback) does each op in one call and one pass over its rows, in float32 with the reference's
rounding points: see that file's header. ``docs/results/cpu-elementwise.md`` has the measurements.

Per call, arguments the kernels do not cover go to the torch provider: a tensor whose last
dimension is not contiguous, rows that no two strides address (a view of 4+ dimensions that does not
flatten), float64, a float64 or strided ``cos_sin_cache``, a rotary_dim above 2048.
"""

from __future__ import annotations

import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import Provider, provider
from vllm_port.ops.activation import check_gated
from vllm_port.ops.norm import check_fused_add_rms_norm, check_rms_norm
from vllm_port.ops.rotary import check_rotary_embedding

from . import native

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]

_CODES = native._DTYPE_CODES
_CONTIGUOUS = torch.contiguous_format


def _torch_provider(name: str) -> Provider:
    """The torch provider of op ``name``, which serves what the kernels do not cover."""
    from . import ops  # here, not at the top: ops imports this module to list its providers

    return getattr(ops, name)


def _lib():
    return native._library if native._loaded else native.library()


def _covered(lib, x: torch.Tensor, *others: torch.Tensor) -> bool:
    """CPU tensors of a dtype the library converts, each with its last dimension contiguous."""
    if lib is None or x.dtype not in _CODES or (x.dtype == torch.float16 and not native._float16):
        return False
    for t in (x, *others):  # a plain loop: this runs on every call
        if not t.is_cpu or (t.stride(-1) != 1 and t.shape[-1] > 1):
            return False
    return True


def _rows(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``t``'s rows (every dimension but the last) as ``(outer, inner, outer_stride, inner_stride)``, or ``None``."""
    shape, strides = t.shape, t.stride()
    if len(shape) == 2:
        return 1, shape[0], 0, strides[0]
    if len(shape) == 3:
        return shape[0], shape[1], strides[0], strides[1]
    if len(shape) == 1:
        return 1, 1, 0, 0
    try:
        flat = t.view(-1, shape[-2], shape[-1])  # 4+ dimensions whose leading ones flatten into one
    except RuntimeError:
        return None
    return flat.shape[0], flat.shape[1], flat.stride(0), flat.stride(1)


def _norm(
    lib, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, epsilon: float
) -> torch.Tensor | None:
    """The norm by the kernel, or ``None`` where no two strides address the rows."""
    rows = _rows(x)
    r_rows = rows if residual is None else _rows(residual)
    if rows is None or r_rows is None:
        return None
    out = torch.empty_like(x, memory_format=_CONTIGUOUS)
    lib.vp_rms_norm(
        out.data_ptr(),
        x.data_ptr(),
        rows[2],
        rows[3],
        None if residual is None else residual.data_ptr(),
        r_rows[2],
        r_rows[3],
        weight.data_ptr(),
        rows[0],
        rows[1],
        x.shape[-1],
        epsilon,
        _CODES[x.dtype],
        torch.get_num_threads(),
    )
    return out


@provider("rms_norm", name="cpu_native_rms_norm", priority=native.NATIVE_PRIORITY, supports=native.available)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_rms_norm(x, weight, epsilon)
    lib = _lib()
    out = _norm(lib, x, None, weight, epsilon) if _covered(lib, x, weight) else None
    return _torch_provider("rms_norm").fn(x, weight, epsilon) if out is None else out


@provider(
    "fused_add_rms_norm",
    name="cpu_native_fused_add_rms_norm",
    priority=native.NATIVE_PRIORITY,
    supports=native.available,
)
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    check_fused_add_rms_norm(x, residual, weight, epsilon)
    lib = _lib()
    out = _norm(lib, x, residual, weight, epsilon) if _covered(lib, x, residual, weight) else None
    return _torch_provider("fused_add_rms_norm").fn(x, residual, weight, epsilon) if out is None else out


@provider("silu_and_mul", name="cpu_native_silu_and_mul", priority=native.NATIVE_PRIORITY, supports=native.available)
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = check_gated("silu_and_mul", x)
    lib = _lib()
    rows = _rows(x) if _covered(lib, x) else None
    if rows is None:
        return _torch_provider("silu_and_mul").fn(x)
    out = x.new_empty((*x.shape[:-1], d))
    lib.vp_silu_and_mul(  # type: ignore[union-attr]
        out.data_ptr(), x.data_ptr(), rows[2], rows[3], rows[0], rows[1], d, _CODES[x.dtype], torch.get_num_threads()
    )
    return out


def _heads(t: torch.Tensor, head_size: int) -> tuple[int, int, int]:
    """``(token_stride, head_stride, heads)`` of ``[tokens, heads * head_size]`` or ``[tokens, heads, head_size]``."""
    strides = t.stride()
    if t.dim() == 2:
        return strides[0], head_size, t.shape[1] // head_size
    return strides[0], strides[1], t.shape[1]


@provider(
    "rotary_embedding", name="cpu_native_rotary_embedding", priority=native.NATIVE_PRIORITY, supports=native.available
)
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    check_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    lib = _lib()
    table = cos_sin_cache.dtype
    if (
        not _covered(lib, query, key, cos_sin_cache)
        or table not in _CODES
        or (table == torch.float16 and not native._float16)
        or not positions.is_cpu
        or cos_sin_cache.shape[1] > 2048
    ):
        return _torch_provider("rotary_embedding").fn(positions, query, key, head_size, cos_sin_cache, is_neox)
    tokens = positions.shape[0]
    if tokens == 0:
        return None
    code = lib.vp_rotary_embedding(  # type: ignore[union-attr]
        positions.data_ptr(),
        positions.stride(0),
        int(positions.dtype == torch.int64),
        tokens,
        query.data_ptr(),
        *_heads(query, head_size),
        key.data_ptr(),
        *_heads(key, head_size),
        cos_sin_cache.data_ptr(),
        cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
        cos_sin_cache.shape[1],
        _CODES[table],
        int(is_neox),
        _CODES[query.dtype],
        torch.get_num_threads(),
    )
    if code == native.ERR_POSITION:  # nothing was written: every position is checked first
        rows = cos_sin_cache.shape[0]
        bad = int(((positions < 0) | (positions >= rows)).nonzero()[0, 0])
        raise OpInputError(
            f"rotary_embedding (provider cpu_native_rotary_embedding): positions[{bad}] is {int(positions[bad])}, "
            f"outside [0, {rows}): cos_sin_cache holds {rows} positions; build it for the model's longest context"
        )
    native._raise("rotary_embedding", code)
    return None
