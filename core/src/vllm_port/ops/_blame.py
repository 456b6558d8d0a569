"""Blame: which provider raised, named in the error, at no cost on the hot path.

A bound op is the provider's own function, so an exception it raises carries the provider's frame.
:func:`blame` (``with blame(kernels): ...``, once around a whole engine step) finds that frame and
re-raises the failure as a :class:`~vllm_port.errors.ProviderError` naming the op, the provider,
its plugin and how to run without it. An :class:`~vllm_port.errors.OpInputError` stays what it is:
the caller's inputs. So does a failure on inputs the op's own input check refuses (run on the
arguments in the provider's frame, after the fact): the provider is named only on evidence against it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import CodeType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ..errors import OpInputError, ProviderError
from ._check_config import CHECK_ENV
from ._checks import validation
from ._provider import who
from ._registry import quarantined

if TYPE_CHECKING:
    from ._provider import Provider

__all__ = ["blame", "provider_fault", "provider_in_traceback", "way_around"]


def way_around(op: str, provider: Provider, instead: str | None) -> str:
    """How to run without ``provider``: another provider for ``op``, or without its plugin."""
    alternative = instead or "reference"
    ways = f"Run without it: VLLM_PORT_OP_PROVIDERS={op}={alternative}"
    if provider.plugin not in ("vllm-port", ""):
        ways += f", or deny its plugin (VLLM_PORT_PLUGINS=-{provider.plugin}) if it only adds kernels"
    if provider.name == "reference":
        ways = "The reference is core's own: report the inputs to vllm-port"
    return f"{ways}; VLLM_PORT_CHECK=1 quarantines a failing provider and keeps running on the next one"


def _code_of(fn: Any) -> CodeType | None:
    fn = getattr(fn, "_init_fn", fn)  # a torch.library custom op made from the provider
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    code = getattr(fn, "__code__", None)
    return code if isinstance(code, CodeType) else None


def provider_in_traceback(exc: BaseException, providers: Mapping[str, Provider]) -> tuple[str, Provider] | None:
    """The op and the bound provider whose frame ``exc`` passed through first (outermost), if any."""
    codes = {}
    for op_name, chosen in providers.items():
        code = _code_of(chosen.fn)
        if code is not None:
            codes.setdefault(code, (op_name, chosen))
    tb = exc.__traceback__
    while tb is not None:
        hit = codes.get(tb.tb_frame.f_code)
        if hit is not None:
            return hit
        tb = tb.tb_next
    return None


class blame:  # noqa: N801 - a context manager that reads as a verb: ``with blame(kernels):``
    """Turn an exception raised inside a bound provider into a :class:`ProviderError` naming it.

    Nothing runs unless an exception leaves the block, so an engine wraps each whole step in it at
    no cost. ``kernels`` is a :class:`BoundOps` or anything with its ``providers`` mapping (and,
    optionally, ``candidates``). An :class:`OpInputError` passes unchanged, with a note of the
    provider that refused the inputs: the inputs broke the op's contract, and when another op's
    provider produced them, debug mode (``VLLM_PORT_CHECK=1``) finds which.
    """

    __slots__ = ("_kernels",)

    def __init__(self, kernels: Any) -> None:
        self._kernels = kernels

    def __enter__(self) -> blame:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, ProviderError):
            return
        found = provider_in_traceback(exc, getattr(self._kernels, "providers", {}))
        if found is None:
            return
        op_name, chosen = found
        if isinstance(exc, OpInputError):
            exc.add_note(
                f"refused by {who(chosen)} for op {op_name!r}; if another op's provider made these inputs, "
                f"{CHECK_ENV}=1 checks every provider's output and names the one at fault"
            )
            return
        refusal = _input_check_refusal(exc, op_name, chosen)
        if refusal is not None:  # evidence that the inputs, not the provider, are at fault
            raise OpInputError(
                f"op {op_name!r}: its inputs are at fault, not {who(chosen)}: it raised {type(exc).__name__}: {exc}, "
                f"and the op's own input check refuses the arguments as the provider held them: {refusal}. "
                f"If another op's provider made these inputs, {CHECK_ENV}=1 checks every provider's output and "
                "names the one at fault"
            ) from exc
        instead = _next_name(getattr(self._kernels, "candidates", {}).get(op_name, ()), chosen)
        raise ProviderError(
            f"op {op_name!r}: {who(chosen)} raised {type(exc).__name__}: {exc}. {way_around(op_name, chosen, instead)}",
            op_name,
            chosen.name,
            chosen.plugin,
        ) from exc


def _input_check_refusal(exc: BaseException, op_name: str, chosen: Provider) -> str | None:
    """What the op's input check (its reference, value checks on) says of the arguments ``chosen`` raised on.

    The arguments are read from the provider's own frame in the traceback, by the op's parameter
    names (a provider's signature is the op's). ``None`` when the check accepts them, when they
    cannot be recovered, or when the check fails for another reason than refusing its inputs:
    then the provider stays the one named.
    """
    from . import ALL_OPS

    op = next((o for o in ALL_OPS if o.name == op_name), None)
    code = _code_of(chosen.fn)
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code is not code:
        tb = tb.tb_next
    if op is None or tb is None:
        return None
    held = tb.tb_frame.f_locals
    names = list(op.signature.parameters)
    if not all(name in held for name in names):
        return None
    args = tuple(held[n].clone() if n in op.mutates and isinstance(held[n], torch.Tensor) else held[n] for n in names)
    try:
        with validation(True):
            op.reference(*args)
    except OpInputError as refused:
        return str(refused)
    except Exception:  # the reference failing otherwise (memory, say) is no evidence either way
        return None
    return None


def provider_fault(kernels: Any, op_name: str, problem: str) -> str:
    """``"op 'x': provider 'p' of plugin 'y' <problem>. Run without it: ..."``: the provider serving ``op_name`` named."""
    chosen = kernels.providers[op_name]
    instead = _next_name(getattr(kernels, "candidates", {}).get(op_name, ()), chosen)
    return f"op {op_name!r}: {who(chosen)} {problem}. {way_around(op_name, chosen, instead)}"


def _next_name(candidates: Sequence[Provider], current: Provider) -> str | None:
    later = [p for p in candidates if p is not current and p.name != current.name and quarantined(p) is None]
    return later[0].name if later else None
