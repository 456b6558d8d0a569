"""An op is its reference implementation, plus what it takes to check any other implementation.

The reference is plain torch: it *is* the op's semantics, the fallback provider and the test oracle.
Around it, an :class:`Op` carries a per-dtype tolerance table (each entry says why), sample inputs
at the shapes real models use, and error inputs that every provider must refuse.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ErrorInput", "Op", "SampleInput", "Tolerance", "compare"]


@dataclass(frozen=True)
class Tolerance:
    """How far a provider's output may be from the float64 reference, and why that much."""

    atol: float
    rtol: float
    reason: str


@dataclass(frozen=True)
class SampleInput:
    """Arguments for one call of an op, with a label naming the case (``"llama3-8b decode"``)."""

    label: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class ErrorInput:
    """Arguments an op must refuse with ``OpInputError``; ``match`` is a substring of the message."""

    label: str
    args: tuple[Any, ...]
    match: str


SampleFactory = Callable[[torch.dtype, torch.device, torch.Generator], Sequence[SampleInput]]
ErrorFactory = Callable[[torch.device], Sequence[ErrorInput]]


@dataclass(frozen=True, eq=False)
class Op:
    """A contract op.

    Attributes:
        name: the op's name, also its attribute on bound ops (``kernels.rms_norm``).
        reference: the plain-torch implementation; every provider's signature must equal its own.
        tolerances: per-dtype distance allowed from the float64 reference.
        samples: makes sample inputs for a dtype and device, small shapes first.
        errors: makes inputs every provider must refuse.
    """

    name: str
    reference: Callable[..., Any]
    tolerances: dict[torch.dtype, Tolerance]
    samples: SampleFactory
    errors: ErrorFactory = lambda device: ()
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signature", inspect.signature(self.reference, eval_str=True))

    @property
    def dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes the contract defines this op for (those with a tolerance)."""
        return frozenset(self.tolerances)

    def __repr__(self) -> str:
        return f"Op({self.name}{self.signature})"


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64)
    return value


def compare(op: Op, args: tuple[Any, ...], actual: Any, dtype: torch.dtype) -> str | None:
    """Check ``actual`` (a provider's output on ``args``) against the float64 reference.

    Returns ``None`` when it is within the op's tolerance for ``dtype``, else a message that says
    where and by how much it is off.
    """
    expected = op.reference(*(_upcast(a) for a in args))
    tol = op.tolerances[dtype]
    if not isinstance(actual, torch.Tensor):
        return f"returned {type(actual).__name__}, expected a Tensor"
    if actual.shape != expected.shape:
        return f"output shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != dtype:
        return f"output dtype {actual.dtype}, expected {dtype}"
    got = actual.detach().to("cpu", torch.float64)
    want = expected.to("cpu")
    bad = ~torch.isclose(got, want, rtol=tol.rtol, atol=tol.atol, equal_nan=False)
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} elements off (atol={tol.atol}, rtol={tol.rtol}); "
        f"first at {index}: got {got[index].item():.6g}, expected {want[index].item():.6g}"
    )
