"""Argument checks shared by references and providers: each error names the op, the argument and the fix.

Two kinds of check (see :mod:`vllm_port.ops.checks` for the policy): *structural* ones read only
metadata (types, dtypes, devices, shapes, strides, Python scalars) and always run; *value* ones read
tensor contents (ids, positions, slots, block tables, lengths, sampling parameters), which on an
accelerator is a device-to-host synchronisation, and run only while validation is on
(:func:`validation_enabled`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch._subclasses.fake_tensor import is_fake

from ..errors import OpInputError
from ..faults import read_switch
from ..graph_capture import is_capturing

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

#: ``VLLM_PORT_VALIDATE=1`` turns the value checks on for the whole process (read once, at the first check).
VALIDATE_ENV = "VLLM_PORT_VALIDATE"
_from_env: bool | None = None  # VLLM_PORT_VALIDATE, once read
_override: ContextVar[bool | None] = ContextVar("vllm_port_validate", default=None)


def validation_enabled() -> bool:
    """Whether op input checks also read tensor values: inside :func:`validation`, else ``VLLM_PORT_VALIDATE``.

    :raises SelectionError: when ``VLLM_PORT_VALIDATE`` is not an on/off switch (discovery refuses it first).
    """
    global _from_env
    forced = _override.get()
    if forced is not None:
        return forced
    if _from_env is None:
        _from_env = read_switch(VALIDATE_ENV)
    return _from_env


@contextmanager
def validation(enabled: bool = True) -> Iterator[None]:
    """Turn the value checks on (or off) for the calls made inside the block, in this thread or task.

    Conformance, the fuzz tests and a debugging session use it; a step under graph capture or
    torch.compile tracing skips the value checks even here (reading a value would break either).
    """
    token = _override.set(enabled)
    try:
        yield
    finally:
        _override.reset(token)


def reads_values(*tensors: torch.Tensor) -> bool:
    """Whether a check may read these tensors' contents now: validation is on, and nothing is being traced or captured."""
    if not validation_enabled() or torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t.device.type == "meta" or is_fake(t):
            return False
    # a host read while a device graph records invalidates the capture: the step is checked when run eagerly
    return not is_capturing()


def check_float(op: str, arg: str, value: object) -> torch.Tensor:
    """Require a floating-point tensor."""
    if not isinstance(value, torch.Tensor):
        raise OpInputError(f"{op}: {arg} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype not in FLOAT_DTYPES:
        raise OpInputError(f"{op}: {arg} has dtype {value.dtype}; pass float32, bfloat16 or float16")
    return value


def check_index(op: str, arg: str, value: object, dims: int | None, like_arg: str, like: torch.Tensor) -> torch.Tensor:
    """Require an int32/int64 tensor of ``dims`` dimensions (any when None) on ``like``'s device."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype not in INDEX_DTYPES
        or (dims is not None and value.dim() != dims)
    ):
        got = f"{value.dtype} of {value.dim()} dims" if isinstance(value, torch.Tensor) else type(value).__name__
        shape = "" if dims is None else f" of {dims} dims"
        raise OpInputError(f"{op}: {arg} must be an int32 or int64 tensor{shape}, got {got}")
    if value.device != like.device:
        raise OpInputError(
            f"{op}: {arg} is on {value.device} but {like_arg} is on {like.device}; move them to one device"
        )
    return value


def check_int(op: str, arg: str, value: object, low: int, why: str) -> int:
    """Require a Python int (not a bool) of at least ``low``; ``why`` says what the argument is."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OpInputError(f"{op}: {arg} must be an int >= {low} ({why}), got {value!r}")
    return value


def first_bad(bad: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True of ``bad`` (one host read), or None when there is none."""
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0])


def check_values_in(op: str, arg: str, value: torch.Tensor, low: int, high: int, fix: str) -> None:
    """Require every element of an index tensor in ``[low, high)`` (reads the values)."""
    at = first_bad((value < low) | (value >= high))
    if at is not None:
        index = ", ".join(map(str, at))
        raise OpInputError(f"{op}: {arg}[{index}] is {int(value[at])}, outside [{low}, {high}); {fix}")


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
    if value.is_contiguous() or value.numel() == 0:  # each element its own memory; or nothing to write
        return
    if any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape, strict=True)):
        raise OpInputError(
            f"{op}: {arg} is an expanded view (strides {value.stride()} for shape {tuple(value.shape)}) and the op "
            f"writes it in place; pass a tensor whose elements each have their own memory (e.g. {arg}.clone())"
        )
