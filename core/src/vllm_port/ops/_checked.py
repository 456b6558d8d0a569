"""Debug mode (``VLLM_PORT_CHECK=<rate>``): every bound op a :class:`CheckedOp`.

Each call's output shape, dtype and device are checked against the op's fake (cached per input
shapes: about a microsecond); the first call of each provider and then a share ``rate`` of the
calls, drawn from a generator seeded by ``VLLM_PORT_CHECK_SEED`` (so the same run checks the same
calls), are compared with the float64 reference within the op's tolerance. In-place arguments are
copied before such a call. On the first fault the inputs are written to a reproducer, the provider
is quarantined for the rest of the process (this call and every later one go to the next
candidate; later binds skip it too) and a warning names it. Strict mode refuses the quarantine and
raises instead. Quarantine takes evidence: a provider that raises is quarantined only when the
reference, on the same inputs, does not raise too.

:func:`checked_ops` wraps a binding; ``Runtime.bind`` calls it where debug mode is on.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import OpInputError, ProviderError
from ..faults import STRICT_ENV, strict_mode
from ..graph_capture import is_capturing
from ._blame import way_around
from ._check_config import CHECK_ENV, CheckConfig
from ._checks import validation
from ._compare import compare_with_reference, metadata_problem
from ._op import Op
from ._provider import who
from ._registry import quarantine, quarantined
from ._repro import write_repro
from ._scrutiny import current_scrutiny

if TYPE_CHECKING:
    from ._provider import Provider
    from ._registry import BoundOps

__all__ = ["CheckedOp", "checked_ops"]

log = logging.getLogger("vllm_port.check")


def checked_ops(kernels: BoundOps, ops: Mapping[str, Op], config: CheckConfig) -> BoundOps:
    """``kernels`` with every op bound as a :class:`CheckedOp` that starts at the provider binding chose."""
    for name, op in ops.items():
        setattr(kernels, name, CheckedOp(op, kernels, kernels.candidates[name], config))
    return kernels


def _capturing() -> bool:
    """Whether the current call is being traced or recorded into a device graph (no host sync allowed)."""
    return torch.compiler.is_compiling() or is_capturing()


class CheckedOp:
    """A bound op in debug mode: calls the current provider, checks it, and moves on when it fails.

    :param op: the op.
    :param kernels: the bound ops it belongs to; their ``providers`` and ``skipped`` follow a quarantine.
    :param candidates: the supported providers in binding order, the one to call first at the head.
    :param config: the sample rate, seed and reproducer folder.
    """

    def __init__(self, op: Op, kernels: BoundOps, candidates: Sequence[Provider], config: CheckConfig) -> None:
        self.op = op
        self.kernels = kernels
        self.candidates = list(candidates)
        self.provider = self.candidates[0]
        self.config = config
        self.dtype = kernels.context.dtype
        params = list(op.signature.parameters.values())
        self._names = [p.name for p in params]
        self._defaults = tuple(p.default for p in params if p.default is not p.empty)
        self._mutated = tuple(i for i, p in enumerate(params) if p.name in op.mutates)
        # seeded per op: the same run checks the same calls (not for security: S311 is about secrets)
        self._rng = random.Random(f"{config.seed}:{op.name}")  # noqa: S311
        self._calls = 0  # calls of the current provider
        self._expected: dict[Any, Any] = {}  # input shapes -> (shape, dtype) of the output, or None
        #: calls compared with the reference, over every provider of this op
        self.compared = 0
        self.__name__ = op.name

    def __repr__(self) -> str:
        return f"CheckedOp({self.op.name}: {self.provider.name}, rate {self.config.rate:g})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != len(self._names):
            args = self._positional(args, kwargs)
        n, self._calls = self._calls, self._calls + 1
        scrutiny = current_scrutiny()
        compare = (n == 0 or scrutiny is not None or self._rng.random() < self.config.rate) and not _capturing()
        before = {i: args[i].clone() for i in self._mutated} if compare else None
        chosen = self.provider
        try:
            out = chosen.fn(*args)
        except OpInputError:
            raise  # the inputs break the op's contract: the caller's fault, whichever provider noticed
        except Exception as exc:
            self._refuse_if_inputs_at_fault(chosen, args, before, exc)
            return self._fault(chosen, args, before, f"raised {type(exc).__name__}: {exc}", exc)
        problem = metadata_problem(self.op, args, out, self._expected)
        if problem is None and compare and chosen.name != "reference":
            self.compared += 1
            problem = compare_with_reference(self.op, chosen, args, before or {}, out, self.dtype)
            if problem is not None:
                problem = f"disagrees with the float64 reference on its call {n + 1}: {problem}"
        if problem is None:
            if scrutiny is not None:
                scrutiny.note_call(self.op.name, chosen, args, before or {}, out, n + 1)
            return out
        return self._fault(chosen, args, before, problem, None)

    def _refuse_if_inputs_at_fault(
        self, chosen: Provider, args: tuple[Any, ...], before: dict[int, torch.Tensor] | None, exc: Exception
    ) -> None:
        """Raise :class:`OpInputError` when the reference also refuses the inputs ``chosen`` raised on.

        The reference runs with its value checks on, on copies of the in-place arguments (as they
        were before the call where they were saved), so the step's tensors are not written. When it
        raises too, the inputs are at fault, not the provider: nothing is quarantined. When it
        cannot say (it ran out of memory), the provider is blamed as before.
        """
        if chosen.name == "reference":
            return
        inputs = tuple(
            (before[i] if before is not None and i in before else a).clone() if i in self._mutated else a
            for i, a in enumerate(args)
        )
        try:
            with validation(True):
                self.op.reference(*inputs)
        except (MemoryError, torch.OutOfMemoryError):
            return
        except Exception as ref_exc:
            raise OpInputError(
                f"op {self.op.name!r}: its inputs are at fault, not {who(chosen)}: it raised {type(exc).__name__}: "
                f"{exc}, and the reference raises on the same inputs too ({type(ref_exc).__name__}: {ref_exc}); "
                "nothing is quarantined. The op or caller that produced these inputs is to blame"
            ) from exc

    def _positional(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        if kwargs:
            bound = self.op.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return tuple(bound.arguments[name] for name in self._names)
        missing = len(self._names) - len(args)
        if 0 < missing <= len(self._defaults):
            return args + self._defaults[len(self._defaults) - missing :]
        return args  # a wrong number of arguments: the provider raises TypeError, as the bare call would

    def _fault(
        self,
        chosen: Provider,
        args: tuple[Any, ...],
        before: dict[int, torch.Tensor] | None,
        problem: str,
        exc: BaseException | None,
    ) -> Any:
        """Report ``chosen``'s fault, quarantine it, and answer this call with the next candidate."""
        op = self.op.name
        intact = before is not None or not self._mutated  # can this call's inputs be given to another provider?
        repro = None
        if intact:
            inputs = tuple(before[i] if before is not None and i in before else a for i, a in enumerate(args))
            try:
                repro = write_repro(self.config.directory, self.op, chosen, self.kernels.context, inputs, problem)
            except Exception as write_exc:  # the report matters more than the file
                log.warning("vllm-port check: could not write a reproducer: %s", write_exc)
        following = [p for p in self.candidates if p is not chosen and quarantined(p) is None]
        successor = following[0] if following else None
        message = f"op {op!r}: {who(chosen)} {problem}"
        where = f" Reproducer: {repro} (replay: vllm-port check-repro {repro})." if repro else ""
        scrutiny = current_scrutiny()
        if scrutiny is not None:
            quarantining = successor is not None and not strict_mode()
            scrutiny.faults.append(f"{message}{'; quarantined' if quarantining else ''}")
        if successor is None or strict_mode():
            reason = (
                f" Strict mode ({STRICT_ENV}=1) forbids moving to the next provider."
                if successor is not None
                else " No other provider can serve it."
            )
            raise ProviderError(
                f"{message}.{reason}{where} {way_around(op, chosen, successor.name if successor else None)}",
                op,
                chosen.name,
                chosen.plugin,
            ) from exc
        quarantine(chosen, message)
        self.provider, self._calls = successor, 0
        self.kernels.providers[op] = successor
        self.kernels.skipped.setdefault(op, []).append((chosen, f"quarantined at run time: {problem}"))
        self.kernels.fallbacks.append(f"{message}; quarantined, {successor.name!r} serves instead")
        log.warning(
            "vllm-port check: %s. Quarantined for the rest of this process; %r serves op %r instead.%s",
            message,
            successor.name,
            op,
            where,
        )
        if not intact:
            raise ProviderError(
                f"{message}. It is quarantined ({successor.name!r} serves the next call), but this call had written "
                f"its in-place arguments, so it cannot be repeated; raise {CHECK_ENV} to compare (and copy) more calls",
                op,
                chosen.name,
                chosen.plugin,
            ) from exc
        if before is not None:
            for i, saved in before.items():
                args[i].copy_(saved)
        return self(*args)
