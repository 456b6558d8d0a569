"""An op is its reference implementation, plus what it takes to check any other implementation.

The reference is plain torch: it *is* the op's semantics, the fallback provider and the test oracle.
Around it, an :class:`Op` carries a per-dtype tolerance table (each entry says why), sample inputs
at the shapes real models use, and error inputs that every provider must refuse.

What every op's contract says about memory layout (checked by :meth:`Op.check` on every sample):
inputs may be strided views (a slice of a fused QKV projection, a transposed weight, a row of a
larger buffer); a returned tensor is new and contiguous; an argument the op writes in place is
written through its view, and no element of its storage outside the view changes; nothing an op
only reads changes, in the view or around it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._variants import IndexedTable, Variants, generate

__all__ = ["ErrorInput", "IndexedTable", "Op", "SampleInput", "Tolerance", "Variants"]


@dataclass(frozen=True)
class Tolerance:
    """How far a provider's output may be from the float64 reference, and why that much."""

    atol: float
    rtol: float
    reason: str


@dataclass(frozen=True)
class SampleInput:
    """Arguments for one call of an op, with a label naming the case (``"llama3-8b decode"``).

    ``large`` marks a case whose size is its point (a 16k context, a batch of 256): devices and
    the CPU providers run it in well under a second, an emulator (Triton's CPU interpreter) in minutes.
    """

    label: str
    args: tuple[Any, ...]
    large: bool = False


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
        hand_samples: makes the hand-written sample inputs for a dtype and device, small shapes
            first (the shapes of real models, each case's meaning in its label); :meth:`samples`
            adds the generated variants.
        errors: makes inputs every provider must refuse.
        fake: computes the output's metadata without data, for torch.compile tracing.
        mutates: names of the arguments the op writes in place (checked like outputs).
        checker: replaces the element-wise comparison for ops whose outputs are not values
            (sampling); same signature and meaning as :meth:`check`.
        invariant: what must hold *exactly* beyond the tolerance, given the sample's arguments and
            the provider's output (attention: a padded sequence's rows are zero); returns what is
            wrong, or None.
        value_errors: makes inputs whose *values* break the contract (a token id past the
            vocabulary, a slot past the cache): every provider must refuse them while validation is
            on (:func:`vllm_port.ops.checks.validation`), which conformance turns on.
        variants: what the op declares about its arguments (index arguments and their dtypes,
            row arguments, indexed tables) for :meth:`samples` to generate variants of one hand
            sample (:mod:`vllm_port.ops._variants`); None generates none.
    """

    name: str
    reference: Callable[..., Any]
    tolerances: dict[torch.dtype, Tolerance]
    hand_samples: SampleFactory
    errors: ErrorFactory = lambda device: ()
    fake: Callable[..., Any] | None = None
    mutates: tuple[str, ...] = ()
    checker: Callable[[Op, Callable[..., Any], tuple[Any, ...], torch.dtype], str | None] | None = None
    invariant: Callable[[tuple[Any, ...], Any], str | None] | None = None
    value_errors: ErrorFactory = lambda device: ()
    variants: Variants | None = None
    signature: inspect.Signature = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "signature", inspect.signature(self.reference, eval_str=True))
        unknown = set(self.mutates) - set(self.signature.parameters)
        if unknown:
            raise ValueError(f"op {self.name!r} mutates unknown arguments {sorted(unknown)}")
        if self.variants is not None:
            declared = {*self.variants.index, *self.variants.rows}
            declared |= {n for t in self.variants.tables for n in (t.index, *t.tables)}
            unknown = declared - set(self.signature.parameters)
            if unknown:
                raise ValueError(f"op {self.name!r} declares variants of unknown arguments {sorted(unknown)}")

    def samples(self, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> list[SampleInput]:
        """The hand samples, then the variants generated from the one :attr:`variants` names as their base.

        A variant's label is ``"<base label>: <what changed>"``; the variants come last, so the
        first samples are the hand-written small ones.
        """
        samples = list(self.hand_samples(dtype, device, gen))
        if self.variants is None:
            return samples
        base = next((s for s in samples if s.label == self.variants.base), None)
        if base is None:
            raise ValueError(f"op {self.name!r}: the variants' base sample {self.variants.base!r} is not a sample")
        names = list(self.signature.parameters)
        made = generate(self.variants, names, base.args, gen)
        return samples + [SampleInput(f"{base.label}: {what}", args, large) for what, args, large in made]

    @property
    def dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes the contract defines this op for (those with a tolerance)."""
        return frozenset(self.tolerances)

    def check(self, fn: Callable[..., Any], args: tuple[Any, ...], dtype: torch.dtype) -> str | None:
        """Run ``fn`` on ``args`` and compare with the float64 reference; ``None`` when it honours the contract.

        Checked: every output and in-place argument element by element against the float64
        reference within the dtype's tolerance; for bfloat16/float16, the error statistics of
        :func:`precision_loss` against the reference run in the input dtype; returned tensors
        contiguous; in-place arguments written through their views and nowhere else in their
        storage; read-only arguments (and the rest of their storage) unchanged; the op's
        ``invariant``. In-place arguments are copied first (views stay views of a copied storage),
        so ``args`` can be reused. Otherwise returns what is wrong, where, and by how much.
        """
        if self.checker is not None:
            return self.checker(self, fn, args, dtype)
        names = list(self.signature.parameters)
        mutated = [i for i, n in enumerate(names[: len(args)]) if n in self.mutates]
        ref_args = tuple(_upcast(a).clone() if i in mutated else _upcast(a) for i, a in enumerate(args))
        got_args = tuple(_copy_keeping_layout(a) if i in mutated else a for i, a in enumerate(args))
        storages = {i: _storage(a).clone() for i, a in enumerate(got_args) if isinstance(a, torch.Tensor)}
        expected, actual = self.reference(*ref_args), fn(*got_args)
        tol = self.tolerances[dtype]
        problems: list[tuple[str, str | None]] = []
        if expected is not None or actual is not None:
            compared = _compare(actual, expected, tol, _out_dtype(expected, dtype))
            problems.append(("output", compared or _layout(actual)))
        problems += [(names[i], _compare(got_args[i], ref_args[i], tol, args[i].dtype)) for i in mutated]
        for i, before in storages.items():
            problems.append((names[i], _stray_writes(got_args[i], before, view_may_change=i in mutated)))
        if not any(msg for _, msg in problems):
            problems += self._precision(args, mutated, ref_args, got_args, expected, actual, dtype)
        if not any(msg for _, msg in problems) and self.invariant is not None:
            problems.append(("output", self.invariant(args, actual)))
        return "; ".join(f"{where}: {msg}" for where, msg in problems if msg) or None

    def _precision(self, args, mutated, ref_args, got_args, expected, actual, dtype) -> list[tuple[str, str | None]]:
        """:func:`precision_loss` of the output and every in-place argument, against the reference in ``dtype``."""
        tol = self.tolerances[dtype]
        if dtype not in _STATS_DTYPES or (tol.atol == 0 and tol.rtol == 0):
            return []
        pairs = [("output", actual, expected)] + [(i, got_args[i], ref_args[i]) for i in mutated]
        if not any(isinstance(e, torch.Tensor) and e.numel() >= STATS_MIN_ELEMENTS for _, _, e in pairs):
            return []
        base_args = tuple(_copy_keeping_layout(a) if i in mutated else a for i, a in enumerate(args))
        baseline = self.reference(*base_args)
        found = []
        for where, got, want in pairs:
            base = baseline if where == "output" else base_args[where]
            name = where if where == "output" else list(self.signature.parameters)[where]
            found.append((name, precision_loss(got, base, want, dtype)))
        return found

    def __repr__(self) -> str:
        return f"Op({self.name}{self.signature})"


#: Error statistics run on outputs of at least this many elements: the mean of 4096 rounding
#: errors is known to about 2%, far inside the factors below.
STATS_MIN_ELEMENTS = 4096
#: A provider's mean absolute error may be this many times that of the reference run in the input
#: dtype (which accumulates in float32). Measured on the samples: correct providers (CPU torch, the
#: Triton kernels with GPU rounding) reach 0.6-1.0x, since they round at most as often as the
#: reference; one rounding more or a lower-precision step costs 1.7-7x (a sum of squares
#: accumulated in bfloat16 tiles 1.7x at 8192 features, rotary products in the input dtype 1.7x,
#: softmax in bfloat16 2-7x, split-K partial sums in bfloat16 2.6x).
MEAN_ERROR_FACTOR = 1.5
#: The largest error may be this many times the reference's: one element is a noisier statistic
#: than the mean, and two correct roundings of the same value can differ by one ulp.
MAX_ERROR_FACTOR = 2.0
#: The dtypes the statistics apply to. float32 outputs are left to the element-wise tolerance: a
#: float32 provider that computes in lower precision (TF32, bfloat16) is off by 1e-3, a hundred
#: times that tolerance.
_STATS_DTYPES = (torch.bfloat16, torch.float16)


def precision_loss(got: Any, baseline: Any, want: Any, dtype: torch.dtype) -> str | None:
    """Whether ``got`` is clearly less precise than ``baseline``, both measured against the float64 ``want``.

    ``baseline`` is what a correct float32-accumulating implementation returns on the same inputs
    (the reference run in the input dtype). A per-element tolerance must admit the worst rounding
    of any element, so a kernel that loses bits on every element (accumulating in bfloat16,
    rounding one step more) stays inside it; over thousands of elements its mean error does not.
    Either error is taken as at least that of rounding ``want`` once to ``dtype`` (the best any
    implementation can return), so a baseline that happens to be exact does not make a correct
    rounding look like a loss.
    """
    if not isinstance(want, torch.Tensor) or not want.is_floating_point() or want.numel() < STATS_MIN_ELEMENTS:
        return None
    want = want.detach().to("cpu", torch.float64)
    got_err = (got.detach().to("cpu", torch.float64) - want).abs()
    base_err = (baseline.detach().to("cpu", torch.float64) - want).abs()
    best_err = (want.to(dtype).to(torch.float64) - want).abs()
    if not all(bool(e.isfinite().all()) for e in (got_err, base_err, best_err)):
        return None  # non-finite values (or values past the dtype's range) are the element-wise comparison's
    got_mean, base_mean = float(got_err.mean()), max(float(base_err.mean()), float(best_err.mean()))
    got_max, base_max = float(got_err.max()), max(float(base_err.max()), float(best_err.max()))
    if got_mean <= MEAN_ERROR_FACTOR * base_mean and got_max <= MAX_ERROR_FACTOR * base_max:
        return None
    ratio = lambda a, b: f"{a / b:.2f}x" if b > 0 else "inf x"  # noqa: E731
    return (
        f"precision lost inside the tolerance over {want.numel()} elements: mean error {got_mean:.3g} "
        f"({ratio(got_mean, base_mean)}, at most {MEAN_ERROR_FACTOR}x allowed) and max error {got_max:.3g} "
        f"({ratio(got_max, base_max)}, at most {MAX_ERROR_FACTOR}x) against float64, where the reference in "
        f"{str(dtype).removeprefix('torch.')} (float32 accumulation) reaches {base_mean:.3g} and {base_max:.3g}"
    )


def _storage(t: torch.Tensor) -> torch.Tensor:
    """Every element of ``t``'s storage, as a flat tensor sharing it (a view's surroundings included)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), 0, (n,), (1,))


def _copy_keeping_layout(value: Any) -> Any:
    """A copy of a tensor *and its whole storage*, so that a view stays the same view (strides, offset)."""
    if not isinstance(value, torch.Tensor):
        return value
    return _storage(value).clone().as_strided(value.shape, value.stride(), value.storage_offset())


def _stray_writes(arg: torch.Tensor, before: torch.Tensor, view_may_change: bool) -> str | None:
    """What the call wrote where it may not: in a read-only argument, or outside an in-place argument's view."""
    after = _storage(arg)
    if _identical(before, after):
        return None
    inside = torch.zeros(after.shape, dtype=torch.bool, device=after.device)
    inside.as_strided(arg.shape, arg.stride(), arg.storage_offset()).fill_(True)
    if not view_may_change and not _identical(before[inside], after[inside]):
        return "was modified, but the op only reads it"
    outside = ~inside
    if _identical(before[outside], after[outside]):
        return None
    changed = int((~_equal_or_both_nan(before[outside], after[outside])).sum())
    return (
        f"{changed} elements of its storage outside the view {tuple(arg.shape)} (strides {arg.stride()}, "
        f"offset {arg.storage_offset()}) were written; write only through the view"
    )


def _equal_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not a.is_floating_point():
        return a == b
    return (a == b) | (a.isnan() & b.isnan())


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64)
    return value


#: Integer dtypes of each float element size: equal bits are equal values (NaN included), in one pass.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN matching NaN (caches are poisoned with NaN where nothing may read)."""
    if not a.is_floating_point():
        return torch.equal(a, b)
    bits = _BITS[a.element_size()]
    if torch.equal(a.view(bits), b.view(bits)):
        return True  # the usual case, untouched storage: one pass, no copies
    if a.element_size() == 1:  # float8: torch has no isnan for it; bits say the same
        return False
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _out_dtype(expected: Any, dtype: torch.dtype) -> torch.dtype:
    return (
        dtype
        if isinstance(expected, torch.Tensor) and expected.is_floating_point()
        else getattr(expected, "dtype", dtype)
    )


def _layout(output: torch.Tensor) -> str | None:
    """``None`` for a contiguous output (what every op returns, and what its fake promises tracing)."""
    if output.is_contiguous():
        return None
    return f"has strides {output.stride()} for shape {tuple(output.shape)}; the contract returns contiguous tensors"


def _compare(actual: Any, expected: Any, tol: Tolerance, dtype: torch.dtype) -> str | None:
    if expected is None:
        return f"returned {type(actual).__name__}, expected None (the op writes its results in place)"
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
