"""Scrutiny: a step re-run with every call of every checked op compared with its reference.

Debug mode's engines call :func:`scrutinize` on a step whose logits were not finite; it names the
first op at fault, or the first whose output was not finite where the reference agrees.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._check_config import CHECK_ENV
from ._provider import who

if TYPE_CHECKING:
    from ._provider import Provider

__all__ = ["Scrutiny", "current_scrutiny", "scrutinize"]


@dataclass
class Scrutiny:
    """What a re-run under :func:`scrutinize` found, in call order.

    Attributes:
        calls: checked calls made.
        faults: each provider fault (quarantined or refused), as debug mode reported it.
        first_non_finite: the first call whose output held NaN or Inf although the provider agreed
            with the reference: ``(op, provider, call number, whether its inputs were finite)``.
    """

    calls: int = 0
    faults: list[str] = field(default_factory=list)
    first_non_finite: tuple[str, Provider, int, bool] | None = None

    def note_call(
        self, op: str, chosen: Provider, args: Sequence[Any], before: Mapping[int, torch.Tensor], out: Any, n: int
    ) -> None:
        """Count a checked call that agreed, and note it if it is the first whose output is not finite.

        :param before: copies of the in-place arguments from before the call, by position. An
            in-place argument counts when the call made it non-finite (a KV cache that held NaN
            before the call, in another request's blocks, does not).
        """
        self.calls += 1
        if self.first_non_finite is not None:
            return
        spoilt = any(_finite(saved) and not _finite(args[i]) for i, saved in before.items())
        if spoilt or not _finite(out):
            inputs = [a for i, a in enumerate(args) if i not in before]
            self.first_non_finite = (op, chosen, n, _finite(inputs))

    def verdict(self) -> str:
        """One sentence: the op at fault, or where non-finite values first appeared, or that nothing did."""
        how = f"debug mode re-ran the step comparing all {self.calls} op calls with their references"
        if self.faults:
            return f"{how}: the first at fault is {self.faults[0]}"
        if self.first_non_finite is not None:
            op, chosen, n, inputs_finite = self.first_non_finite
            source = (
                "on finite inputs, and the reference's output is not finite either: the values overflow the dtype "
                "(load the model in a wider dtype)"
                if inputs_finite
                else "from inputs that already held NaN or Inf (the weights, the KV cache or the step's own inputs), "
                "and the reference agrees"
            )
            return f"{how}: the first output holding NaN or Inf was op {op!r}'s call {n} ({who(chosen)}), {source}; no provider is at fault"
        return (
            f"{how}, and every output was finite and agreed: the fault did not recur (a provider failing now and "
            f"then, or a step that is not checked, such as a captured graph: set {CHECK_ENV} nearer 1 to compare "
            "more calls of the normal run)"
        )


_SCRUTINY: ContextVar[Scrutiny | None] = ContextVar("vllm_port_scrutiny", default=None)


def current_scrutiny() -> Scrutiny | None:
    """The scrutiny the current call runs under (inside :func:`scrutinize`), or ``None``."""
    return _SCRUTINY.get()


def scrutinize(rerun: Callable[[], Any]) -> Scrutiny:
    """Call ``rerun`` with every call of every :class:`CheckedOp` compared with its reference; what it found.

    A provider found at fault is quarantined as in debug mode (and the call answered by the next
    candidate); in strict mode the first fault raises :class:`ProviderError`. Without debug mode
    nothing is checked and the scrutiny finds nothing (``calls == 0``).
    """
    found = Scrutiny()
    token = _SCRUTINY.set(found)
    try:
        rerun()
    finally:
        _SCRUTINY.reset(token)
    return found


def _finite(values: Any) -> bool:
    if isinstance(values, torch.Tensor):
        return not values.is_floating_point() or bool(values.isfinite().all())
    if isinstance(values, (tuple, list)):
        return all(_finite(v) for v in values)
    return True
