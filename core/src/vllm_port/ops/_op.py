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

__all__ = ["ErrorInput", "Op", "SampleInput", "Tolerance"]


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
        fake: computes the output's metadata without data, for torch.compile tracing.
        mutates: names of the arguments the op writes in place (checked like outputs).
        checker: replaces the element-wise comparison for ops whose outputs are not values
            (sampling); same signature and meaning as :meth:`check`.
    """

    name: str
    reference: Callable[..., Any]
    tolerances: dict[torch.dtype, Tolerance]
    samples: SampleFactory
    errors: ErrorFactory = lambda device: ()
    fake: Callable[..., Any] | None = None
    mutates: tuple[str, ...] = ()
    checker: Callable[[Op, Callable[..., Any], tuple[Any, ...], torch.dtype], str | None] | None = None
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signature", inspect.signature(self.reference, eval_str=True))
        unknown = set(self.mutates) - set(self.signature.parameters)
        if unknown:
            raise ValueError(f"op {self.name!r} mutates unknown arguments {sorted(unknown)}")

    @property
    def dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes the contract defines this op for (those with a tolerance)."""
        return frozenset(self.tolerances)

    def check(self, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
        """Run ``fn`` on ``args`` and compare with the float64 reference; ``None`` when within tolerance.

        Arguments the op mutates are cloned first, so ``args`` can be reused; the arguments it only
        reads must come back unchanged. Otherwise returns what is wrong, where, and by how much.
        """
        if self.checker is not None:
            return self.checker(self, fn, args, dtype)
        names = list(self.signature.parameters)
        mutated = [i for i, n in enumerate(names[: len(args)]) if n in self.mutates]
        ref_args = tuple(_upcast(a).clone() if i in mutated else _upcast(a) for i, a in enumerate(args))
        got_args = tuple(a.clone() if i in mutated else a for i, a in enumerate(args))
        read_only = {i: a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in mutated}
        expected, actual = self.reference(*ref_args), fn(*got_args)
        tol = self.tolerances[dtype]
        problems = (
            []
            if expected is None and actual is None
            else [("output", _compare(actual, expected, tol, _out_dtype(expected, dtype)))]
        )
        problems += [(names[i], _compare(got_args[i], ref_args[i], tol, args[i].dtype)) for i in mutated]
        problems += [
            (names[i], "was modified, but the op only reads it")
            for i, a in read_only.items()
            if not _identical(a, args[i])
        ]
        return "; ".join(f"{where}: {msg}" for where, msg in problems if msg) or None

    def __repr__(self) -> str:
        return f"Op({self.name}{self.signature})"


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64)
    return value


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN matching NaN (caches are poisoned with NaN where nothing may read)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _out_dtype(expected: Any, dtype: torch.dtype) -> torch.dtype:
    return (
        dtype
        if isinstance(expected, torch.Tensor) and expected.is_floating_point()
        else getattr(expected, "dtype", dtype)
    )


def _compare(actual: Any, expected: Any, tol: Tolerance, dtype: torch.dtype) -> str | None:
    if not isinstance(actual, torch.Tensor):
        return f"returned {type(actual).__name__}, expected a Tensor"
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.dtype != dtype:
        return f"dtype {actual.dtype}, expected {dtype}"
    got = actual.detach().to("cpu", torch.float64)
    want = expected.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(got, want, rtol=tol.rtol, atol=tol.atol, equal_nan=False)
    if not bool(bad.any()):
        return None
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} elements off (atol={tol.atol}, rtol={tol.rtol}); "
        f"first at {index}: got {got[index].item():.6g}, expected {want[index].item():.6g}"
    )
