"""Repeat launches of a compiled Triton kernel without Triton's per-call binding (issue 30: eager launch <= 25 us).

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run`` on every call: it binds the
arguments to the signature, specialises each one (dtype, 16-byte alignment, integer width, the value
1), formats the options into a cache key, looks the compiled kernel up and builds its launch metadata,
all before the driver launch (``docs/results/launch-cost-h100.md`` measures what that costs).
:func:`cached_launch` wraps a ``@triton.jit`` kernel so that the call sites keep that syntax, and a
launch whose arguments specialise as an earlier one's calls that earlier call's compiled kernel directly.

Why this cannot pick the wrong binary: the cache key (:func:`specialisation`) holds, for every
argument, at least what Triton specialises on (a refinement of its key, tested against Triton's own
``native_specialize_impl`` in ``core/tests/triton/test_cached_launch.py``), plus every keyword with
its type (constexprs and options) and the device. A first launch
under a key goes through Triton as before, which compiles or finds the kernel and returns it. These
launch through Triton every time, and are never kept: arguments the key does not describe (a tensor
descriptor, a tuple, a dtype object), a constexpr passed positionally (the key holds positional
integers by class, Triton a constexpr by value), a grid given as a function, launches while Triton
instruments them (a launch hook set, as a profiler does; ``knobs.runtime.debug``; an instrumentation
mode: each compiles or calls another kernel), and every launch under the interpreter
(``TRITON_INTERPRET=1``), where there is no compiled kernel. A kernel's global constants are read when
it compiles: Triton's launch refuses one changed since, a cached launch does not look. The direct call is
what Triton 3.6's ``JITFunction.run`` calls on CUDA (its compiled kernel's C launcher, through
``CompiledKernel.run`` where the kernel has scratch memory to allocate), with a CUDA tensor passed as its
address as that launcher would resolve it; other Triton versions and other drivers (ROCm's, XPU's: never
run here) launch through Triton every time.

``VLLM_PORT_TRITON_CACHED_LAUNCH=0`` turns the cache off: every launch goes through Triton's binder.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.jit import JITFunction

from ...faults import read_switch

__all__ = [
    "CACHED_LAUNCH_ENV",
    "KNOWN_TRITON",
    "CachedLaunch",
    "cached_launch",
    "cdiv",
    "next_power_of_2",
    "specialisation",
]

#: The switch that turns the cache off (on by default).
CACHED_LAUNCH_ENV = "VLLM_PORT_TRITON_CACHED_LAUNCH"
_I32_MIN, _I32_MAX, _U64_MIN = -(2**31), 2**31 - 1, 2**63
#: Keyword values a key may hold (constexprs, options); a launch with any other keyword goes through Triton.
_CONSTANT_KINDS = frozenset({int, float, bool, str, type(None)})
#: Keys one kernel keeps at most (a float keyword varying per call must not grow the cache without bound).
_MOST_KEYS = 1024


def specialisation(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What of positional ``args`` a compiled kernel depends on, at least what Triton's binder specialises on;
    ``None`` when one of them is of a kind it does not describe.

    A tensor: its dtype and 16-byte alignment. An integer, as one small code (no tuple: a launch has up
    to 25 of them, and this runs on every one): 1 for the value 1 (a constant to Triton), then by width
    (32 or 64 bits, signed or not) and divisibility by 16. A float: its type. A bool or None: a value
    no integer code equals (``True == 1`` in a tuple key, and Triton compiles them apart).
    """
    bound = _bind(args)
    return None if bound is None else bound[0]


def _bind(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any]] | None:
    """:func:`specialisation` of ``args``, and the values Triton's launcher takes for them, in one pass.

    A CUDA tensor is passed as its address (an ``int``), as Triton's launcher would resolve it: for an
    object it calls ``data_ptr()`` and asks the driver for the device address (``cuPointerGetAttribute``),
    which is the same address for CUDA memory (unified addressing) and only refuses host memory. Any other
    tensor is passed as it is, so that the launcher checks it as before (and refuses a CPU tensor).
    """
    key: list[Any] = []
    passed: list[Any] = []
    keep, give = key.append, passed.append  # bound once: this loop runs for every argument of every launch
    for arg in args:
        kind = type(arg)
        if kind is int:
            if arg == 1:
                keep(1)
            elif _I32_MIN <= arg <= _I32_MAX:
                keep(2 if arg & 15 == 0 else 3)
            else:
                keep((4 if arg < _U64_MIN else 6) + (arg & 15 != 0))
            give(arg)
        elif kind is torch.Tensor or isinstance(arg, torch.Tensor):
            address = arg.data_ptr()
            keep(arg.dtype)  # then its alignment: only a tensor puts a dtype in the key, so it parses one way
            keep(address & 15 == 0)
            give(address if arg.is_cuda else arg)
        elif kind is float:
            keep(float)
            give(arg)
        elif kind is bool:
            keep("true" if arg else "false")
            give(arg)
        elif arg is None:
            keep(None)
            give(arg)
        else:
            return None
    return tuple(key), passed


def _keyed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[Any]] | None:
    """The cache key of a launch (the arguments' :func:`specialisation`, every keyword with its type: ``True``
    and ``1`` are keyed apart; the current device) and the positional values to pass; ``None`` when it cannot be
    keyed (a tensor by keyword)."""
    bound = _bind(args)
    if bound is None:
        return None
    values = tuple(kwargs.values())
    kinds = tuple(map(type, values))
    if not _CONSTANT_KINDS.issuperset(kinds):
        return None
    spec, passed = bound
    return (spec, tuple(kwargs), values, kinds, torch._C._cuda_getDevice()), passed


class CachedLaunch:
    """A ``@triton.jit`` kernel launched as ``kernel[grid](*args, **constexprs)``, repeat launches straight
    to the compiled kernel; any other attribute is the kernel's (``warmup``, ``fn``, ...)."""

    def __init__(self, kernel: JITFunction) -> None:
        self.kernel = kernel
        self._params = kernel.params  # Triton's own view of the signature: names, defaults, constexprs
        # positional arguments a key may hold: those before the first constexpr parameter
        self._positional = next((p.num for p in self._params if p.is_constexpr), len(self._params))
        # (positional specialisation, keywords, device) -> (what to call, the arguments it takes before the
        # kernel's, the values of the parameters after the positional ones): see _launcher
        self._compiled: dict[tuple[Any, ...], tuple[Callable[..., Any], tuple[Any, ...], tuple[Any, ...]]] = {}
        #: launches that went through Triton's binder (first launches under a key, and those it cannot key)
        self.through_triton = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        return functools.partial(self._launch, grid)

    def _launch(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        keyed = _on() and len(args) <= self._positional and not callable(grid)
        bound = _keyed(args, kwargs) if keyed else None
        hit = None if bound is None else self._compiled.get(bound[0])
        if hit is None or _instrumented():
            self.through_triton += 1
            compiled = self.kernel[grid](*args, **kwargs)
            if bound is not None and compiled is not None and len(self._compiled) < _MOST_KEYS and not _instrumented():
                self._compiled[bound[0]] = (*_launcher(compiled), self._rest(len(args), kwargs))
            return
        launcher, head, rest = hit
        stream = torch._C._cuda_getCurrentRawStream(bound[0][-1])
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        launcher(grid[0], g1, g2, stream, *head, *bound[1], *rest)

    def _rest(self, given: int, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The values of the parameters after the ``given`` positional ones, as Triton binds them (keywords,
        then defaults): the same for every launch under one key, since every keyword is in it."""
        return tuple(kwargs[p.name] if p.name in kwargs else p.default for p in self._params[given:])


#: The Triton versions whose ``CompiledKernel.run`` takes the arguments :meth:`CachedLaunch._launch` passes.
KNOWN_TRITON = ("3.6",)


@functools.cache
def _on() -> bool:
    """Whether launches may skip Triton's binder: the switch on, compiled kernels (not the interpreter),
    CUDA's driver and a Triton version whose compiled-kernel call is known."""
    return (
        read_switch(CACHED_LAUNCH_ENV, default=True)
        and not triton.knobs.runtime.interpret
        and torch.version.cuda is not None
        and torch.version.hip is None
        and triton.__version__.startswith(tuple(v + "." for v in KNOWN_TRITON))
    )


def _instrumented() -> bool:
    """Whether Triton instruments launches now: a launch hook set (a profiler's), which Triton calls; debug mode or
    an instrumentation mode, which Triton keys its compiled kernels on (each compiles another kernel)."""
    runtime = triton.knobs.runtime  # attribute reads only: this runs on every launch
    return (
        _set(runtime.launch_enter_hook)
        or _set(runtime.launch_exit_hook)
        or bool(runtime.debug)
        or bool(triton.knobs.compilation.instrumentation_mode)
    )


def _set(hook: Any) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # Triton 3.6 keeps a chain, empty when unset


def _launcher(compiled: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """What a repeat launch of ``compiled`` calls, and the arguments it takes between the stream and the kernel's.

    Triton 3.6's ``CompiledKernel.run`` (a ``CudaLauncher``) allocates the kernel's scratch memory if it has any,
    then calls its C launcher with the cooperative-grid and PDL flags, the scratch buffers, the packed metadata,
    no launch metadata and no hooks (none is set: see :func:`_instrumented`). A kernel without scratch memory
    skips that Python frame and calls the C launcher itself, with what ``CudaLauncher`` would pass.
    """
    run = compiled.run
    direct = getattr(run, "launch", None)
    if direct is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return run, (compiled.function, compiled.packed_metadata, None, None, None)
    flags = (run.launch_cooperative_grid, run.launch_pdl)
    return direct, (compiled.function, *flags, None, None, compiled.packed_metadata, None, None, None)


def cached_launch(kernel: JITFunction) -> CachedLaunch | JITFunction:
    """``kernel`` with repeat launches straight to its compiled kernel (a decorator above ``@triton.jit``).

    Under the interpreter ``triton.jit`` returns an interpreted function, which is returned as it is.
    """
    return CachedLaunch(kernel) if isinstance(kernel, JITFunction) else kernel


def cdiv(x: int, y: int) -> int:
    """``triton.cdiv`` for host code: the same integer, without a constexpr function's call (about 1 us a call)."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` for host code: the smallest power of two >= ``n`` (0 for ``n`` <= 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
