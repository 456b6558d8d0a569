"""Argument checks shared by references and providers: each error names the op, the argument and the fix."""

from __future__ import annotations

import torch

from ..errors import OpInputError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_float(op: str, arg: str, value: object) -> torch.Tensor:
    """Require a floating-point tensor."""
    if not isinstance(value, torch.Tensor):
        raise OpInputError(f"{op}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise OpInputError(f"{op}: {arg} has dtype {value.dtype}; pass float32, bfloat16 or float16")
    return value


def check_same(op: str, arg: str, value: torch.Tensor, like_arg: str, like: torch.Tensor) -> None:
    """Require ``value`` to share ``like``'s dtype and device."""
    if value.dtype != like.dtype:
        raise OpInputError(
            f"{op}: {arg} has dtype {value.dtype} but {like_arg} has {like.dtype}; cast them to one dtype"
        )
    if value.device != like.device:
        raise OpInputError(
            f"{op}: {arg} is on {value.device} but {like_arg} is on {like.device}; move them to one device"
        )


def check_writable(op: str, arg: str, value: torch.Tensor) -> None:
    """Require an argument the op writes in place to give every element its own memory.

    Any strided view is fine; an expanded one (a stride of 0 over a dimension of size > 1) is not:
    one write would land in several elements. Metadata only, no device synchronisation.
    """
    if any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape, strict=True)):
        raise OpInputError(
            f"{op}: {arg} is an expanded view (strides {value.stride()} for shape {tuple(value.shape)}) and the op "
            f"writes it in place; pass a tensor whose elements each have their own memory (e.g. {arg}.clone())"
        )
