"""Providers that misbehave at run time: naming them, checking them, and taking them out of service.

Three tools, from free to thorough:

* **Blame** (always, no cost on the hot path): a bound op is the provider's own function, so an
  exception it raises carries the provider's frame. :func:`blame` (``with blame(kernels): ...``, once
  around a whole engine step) finds that frame and re-raises the failure as a
  :class:`~vllm_port.errors.ProviderError` naming the op, the provider, its plugin and how to run
  without it. An :class:`~vllm_port.errors.OpInputError` stays what it is: the caller's inputs. So
  does a failure on inputs the op's own input check refuses (run on the arguments in the
  provider's frame, after the fact): the provider is named only on evidence against it.
* **Smoke check at bind** (``runtime.bind(dtype, verify=True)``; ``vllm-port doctor`` always):
  :func:`smoke_check` runs each candidate on its op's small samples against the float64
  reference, and one that raises, returns the wrong shape, dtype or device, or wrong values is
  skipped for the next candidate, with the reason in ``BoundOps.skipped``.
* **Debug mode** (``VLLM_PORT_CHECK=<rate>``): every bound op becomes a :class:`CheckedOp`. Each
  call's output shape, dtype and device are checked against the op's fake (cached per input
  shapes: about a microsecond); the first call of each provider and then a share ``rate`` of the
  calls, drawn from a generator seeded by ``VLLM_PORT_CHECK_SEED`` (so the same run checks the same
  calls), are compared with the float64 reference within the op's tolerance. In-place arguments
  are copied before such a call. On the first fault the inputs are written to a reproducer
  (safetensors + JSON, under ``VLLM_PORT_CHECK_DIR``, replayed by ``vllm-port check-repro FILE``),
  the provider is **quarantined** for the rest of the process (this call and every later one go
  to the next candidate; later binds skip it too) and a warning names it. Strict mode refuses
  the quarantine and raises instead. Quarantine takes evidence: a provider that raises is
  quarantined only when the reference, on the same inputs, does not raise too (when it does, the
  inputs are at fault: an :class:`~vllm_port.errors.OpInputError` says so and nobody is quarantined).
* **Scrutiny** (:func:`scrutinize`, debug mode only): re-run a step, typically one whose logits
  were not finite, with every call of every checked op compared with its reference, and name the
  first op at fault, or the first whose output was not finite where the reference agrees.

What debug mode does not see: calls inside a captured device graph (replays run no Python) or a
compiled graph (``bind(traceable=True)`` is left unchecked); run such engines eagerly to check them.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, TracebackType
from typing import TYPE_CHECKING, Any

import torch

from ..errors import OpInputError, ProviderError, SelectionError
from ..faults import STRICT_ENV, strict_mode
from ..graph_capture import is_capturing
from ._checks import validation
from ._op import Op, SampleInput

if TYPE_CHECKING:
    from ._registry import BoundOps, Provider

__all__ = [
    "CHECK_DIR_ENV",
    "CHECK_ENV",
    "CHECK_SEED_ENV",
    "DEFAULT_CHECK_RATE",
    "CheckConfig",
    "CheckedOp",
    "blame",
    "check_config",
    "clear_quarantine",
    "provider_fault",
    "quarantine",
    "quarantined",
    "replay",
    "scrutinize",
    "smoke_check",
]

CHECK_ENV = "VLLM_PORT_CHECK"
CHECK_DIR_ENV = "VLLM_PORT_CHECK_DIR"
CHECK_SEED_ENV = "VLLM_PORT_CHECK_SEED"
#: ``VLLM_PORT_CHECK=on``: one call in a hundred (besides each provider's first) is compared with the reference.
DEFAULT_CHECK_RATE = 0.01
DEFAULT_CHECK_DIR = "vllm-port-check"
#: Samples of each op a smoke check runs (the op's smallest: milliseconds each on a CPU).
SMOKE_SAMPLES = 2
REPRO_FORMAT = "vllm-port-check-repro/1"

log = logging.getLogger("vllm_port.check")


# -------------------------------------------------------------------------------------------------
# Messages
# -------------------------------------------------------------------------------------------------


def who(provider: Provider) -> str:
    """``"provider 'x' of plugin 'y'"``: how every message names a provider."""
    return f"provider {provider.name!r} of plugin {provider.plugin!r}"


def way_around(op: str, provider: Provider, instead: str | None) -> str:
    """How to run without ``provider``: another provider for ``op``, or without its plugin."""
    alternative = instead or "reference"
    ways = f"Run without it: VLLM_PORT_OP_PROVIDERS={op}={alternative}"
    if provider.plugin not in ("vllm-port", ""):
        ways += f", or deny its plugin (VLLM_PORT_PLUGINS=-{provider.plugin}) if it only adds kernels"
    if provider.name == "reference":
        ways = "The reference is core's own: report the inputs to vllm-port"
    return f"{ways}; VLLM_PORT_CHECK=1 quarantines a failing provider and keeps running on the next one"


# -------------------------------------------------------------------------------------------------
# Blame: which provider raised
# -------------------------------------------------------------------------------------------------


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


# -------------------------------------------------------------------------------------------------
# Quarantine: providers found faulty in this process
# -------------------------------------------------------------------------------------------------

_QUARANTINE: dict[tuple[str, str, str, str], str] = {}


def _key(provider: Provider) -> tuple[str, str, str, str]:
    return (provider.op, provider.plugin, provider.platform, provider.name)


def quarantine(provider: Provider, reason: str) -> None:
    """Take ``provider`` out of service for the rest of the process: no later bind chooses it."""
    _QUARANTINE.setdefault(_key(provider), reason)


def quarantined(provider: Provider) -> str | None:
    """Why ``provider`` was quarantined in this process, or ``None``."""
    return _QUARANTINE.get(_key(provider)) if _QUARANTINE else None


def clear_quarantine() -> None:
    """Put every quarantined provider back in service (tests)."""
    _QUARANTINE.clear()


# -------------------------------------------------------------------------------------------------
# Smoke check: a candidate on the op's small samples, before it is bound
# -------------------------------------------------------------------------------------------------

_SAMPLES: dict[tuple[str, torch.dtype, str], tuple[SampleInput, ...]] = {}


def smoke_samples(op: Op, dtype: torch.dtype, device: torch.device) -> tuple[SampleInput, ...]:
    """``op``'s first :data:`SMOKE_SAMPLES` samples for ``dtype`` on ``device``, made once per process."""
    key = (op.name, dtype, str(device))
    if key not in _SAMPLES:  # making an op's samples takes up to a few hundred ms: once per process
        _SAMPLES[key] = tuple(op.samples(dtype, device, torch.Generator().manual_seed(0))[:SMOKE_SAMPLES])
    return _SAMPLES[key]


def _on_inputs_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, refusing outputs on another device than its inputs' (``Op.check`` compares values only)."""

    def call(*args: Any) -> Any:
        out = fn(*args)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if isinstance(out, torch.Tensor) and device is not None and out.device != device:
            raise _WrongDeviceError(f"returned a tensor on {out.device}, but the inputs are on {device}")
        return out

    return call


class _WrongDeviceError(Exception):
    pass


def smoke_check(op: Op, provider: Provider, dtype: torch.dtype, device: torch.device) -> str | None:
    """Run ``provider`` on ``op``'s smallest samples against the float64 reference; ``None`` when it passes.

    Otherwise says what is wrong on which sample: an exception, a wrong shape, dtype or device,
    values outside the tolerance, writes where the op only reads.
    """
    for sample in smoke_samples(op, dtype, device):
        try:
            problem = op.check(_on_inputs_device(provider.fn), sample.args, dtype)
        except _WrongDeviceError as exc:
            problem = str(exc)
        except Exception as exc:  # a smoke check reports; it never takes binding down
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem:
            _SAMPLES.pop((op.name, dtype, str(device)), None)  # it may have written into the samples
            return f"on sample {sample.label!r}: {problem}"
    return None


# -------------------------------------------------------------------------------------------------
# Scrutiny: a step re-run with every checked call compared
# -------------------------------------------------------------------------------------------------


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


# -------------------------------------------------------------------------------------------------
# Debug mode
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckConfig:
    """Debug mode's settings: the share of calls compared, the seed that picks them, where reproducers go."""

    rate: float
    seed: int = 0
    directory: Path = Path(DEFAULT_CHECK_DIR)


def check_config(spec: str | None = None) -> CheckConfig | None:
    """Debug mode's settings from ``spec`` (else ``VLLM_PORT_CHECK``), or ``None`` when it is off.

    ``0``/``off``/empty: off; ``on``: :data:`DEFAULT_CHECK_RATE`; a number in (0, 1]: that share of
    calls (``1``: every call). ``VLLM_PORT_CHECK_SEED`` (default 0) and ``VLLM_PORT_CHECK_DIR``
    (default ``./vllm-port-check``) complete it.

    :raises SelectionError: for a rate or seed that is not one.
    """
    seed = _check_seed()  # read even when debug mode is off: an invalid seed is an error in every mode
    raw = (os.environ.get(CHECK_ENV, "") if spec is None else spec).strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw in ("on", "true", "yes"):
        rate = DEFAULT_CHECK_RATE
    else:
        try:
            rate = float(raw)
        except ValueError:
            rate = math.nan
        if not 0 < rate <= 1:
            raise SelectionError(
                f"{CHECK_ENV}={raw!r} is not a share of calls; give a number in (0, 1] (0.01: one call in a hundred, "
                f"1: every call), 'on' for {DEFAULT_CHECK_RATE}, or 0 to turn debug mode off"
            )
    return CheckConfig(rate, seed, Path(os.environ.get(CHECK_DIR_ENV) or DEFAULT_CHECK_DIR))


def _check_seed() -> int:
    seed_text = os.environ.get(CHECK_SEED_ENV, "0").strip() or "0"
    try:
        return int(seed_text)
    except ValueError:
        raise SelectionError(f"{CHECK_SEED_ENV}={seed_text!r} is not an integer seed") from None


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
        scrutiny = _SCRUTINY.get()
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
                self._note_output(scrutiny, chosen, args, before or {}, out, n + 1)
            return out
        return self._fault(chosen, args, before, problem, None)

    def _note_output(
        self,
        scrutiny: Scrutiny,
        chosen: Provider,
        args: tuple[Any, ...],
        before: dict[int, torch.Tensor],
        out: Any,
        n: int,
    ) -> None:
        """Under scrutiny: count the call, and note it if it is the first whose (agreed) output is not finite.

        An in-place argument counts when the call made it non-finite (a KV cache that held NaN
        before the call, in another request's blocks, does not).
        """
        scrutiny.calls += 1
        if scrutiny.first_non_finite is not None:
            return
        spoilt = any(_finite(saved) and not _finite(args[i]) for i, saved in before.items())
        if spoilt or not _finite(out):
            inputs = [a for i, a in enumerate(args) if i not in self._mutated]
            scrutiny.first_non_finite = (self.op.name, chosen, n, _finite(inputs))

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
        scrutiny = _SCRUTINY.get()
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


_UNKNOWN = object()  # the fake cannot say (it raised, or answered something else than a tensor or None)
_MISSING = object()


def metadata_problem(op: Op, args: tuple[Any, ...], out: Any, cache: dict[Any, Any] | None = None) -> str | None:
    """``out``'s shape, dtype and device against ``op``'s fake for ``args``; O(1) in the data.

    :param cache: input shapes -> the fake's answer, kept between calls (a microsecond per call when it hits).
    """
    if op.fake is None:
        return None
    try:
        key: Any = tuple([(a.shape, a.dtype) if isinstance(a, torch.Tensor) else a for a in args])
        expected = _MISSING if cache is None else cache.get(key, _MISSING)
    except TypeError:  # an unhashable argument: no caching
        key, expected = None, _MISSING
    if expected is _MISSING:
        expected = _fake_output(op, args)
        if cache is not None and key is not None and len(cache) < 4096:
            cache[key] = expected
    if expected is _UNKNOWN:
        return None
    if expected is None:
        return None if out is None else f"returned {type(out).__name__}; the op writes in place and returns None"
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    shape, dtype = expected
    if out.shape != shape:
        return f"returned shape {tuple(out.shape)}, expected {tuple(shape)}"
    if out.dtype != dtype:
        return f"returned dtype {out.dtype}, expected {dtype}"
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None  # every op's first argument, so far
    device = (
        first.device if first is not None else next((a.device for a in args if isinstance(a, torch.Tensor)), out.device)
    )
    if out.device != device:
        return f"returned a tensor on {out.device}, but the inputs are on {device}"
    return None


def _fake_output(op: Op, args: tuple[Any, ...]) -> Any:
    """``(shape, dtype)`` of ``op``'s output for ``args``' metadata, ``None`` for an in-place op, or ``_UNKNOWN``."""
    try:
        metas = tuple(
            torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a
            for a in args
        )
        out = op.fake(*metas)  # type: ignore[misc]
    except Exception:
        return _UNKNOWN
    if out is None:
        return None
    return (out.shape, out.dtype) if isinstance(out, torch.Tensor) else _UNKNOWN


def _upcast_copy(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64, copy=True)
    return t.clone() if isinstance(t, torch.Tensor) else t


def _upcast(t: Any) -> Any:
    return t.detach().to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def compare_with_reference(
    op: Op, chosen: Provider, args: tuple[Any, ...], before: Mapping[int, torch.Tensor], out: Any, dtype: torch.dtype
) -> str | None:
    """What ``chosen`` got wrong in one call, against the reference on the same inputs; ``None`` if nothing.

    :param args: the call's arguments, in-place ones as ``chosen`` left them.
    :param before: copies of the in-place arguments from before the call.
    :param out: what ``chosen`` returned.

    First the reference runs in ``dtype`` (as cheap as the provider: no float64 copy of the weights
    or the KV cache), and a provider within the op's tolerance of it passes. Otherwise the float64
    reference decides, as conformance does: an element is wrong when it is outside the tolerance of
    the float64 reference *and* the reference in ``dtype`` lands inside it (where even the
    reference in ``dtype`` cannot meet the tolerance on these inputs, the tolerance does not fit
    them, and the provider is not blamed). So a provider off by less than twice the tolerance may
    pass a sampled call; gross faults (wrong values, NaN) never do.
    """
    if op.name == "sample":
        return _compare_draws(op, chosen, args, out)
    if op.checker is not None:
        return None  # an op whose outputs are not values: only its metadata is checked
    tol = op.tolerances.get(dtype)
    if tol is None:
        return None
    inputs = tuple(before.get(i, a) for i, a in enumerate(args))
    mutated = sorted(before)
    base_args = tuple(a.clone() if i in before else a for i, a in enumerate(inputs))
    base_out = op.reference(*base_args)
    names = list(op.signature.parameters)
    pairs = [("output", out, base_out, None)] if base_out is not None else []
    pairs += [(f"{names[i]} (written in place)", args[i], base_args[i], i) for i in mutated]
    suspects = [pair for pair in pairs if not _close(pair[1], pair[2], tol)]
    if not suspects:
        return None
    ref_args = tuple(_upcast_copy(a) if i in before else _upcast(a) for i, a in enumerate(inputs))
    expected = op.reference(*ref_args)
    problems = []
    for where, got, base, index in suspects:
        want = expected if index is None else ref_args[index]
        found = _disagreement(got, want, tol, base)
        if found:
            problems.append(f"{where}: {found}")
    return "; ".join(problems) or None


def _close(got: Any, base: Any, tol: Any) -> bool:
    """Whether ``got`` is within the tolerance of the reference run in the input dtype (on the device)."""
    if not isinstance(got, torch.Tensor) or not isinstance(base, torch.Tensor) or got.shape != base.shape:
        return False
    if not got.is_floating_point():
        return bool(torch.equal(got, base))
    return bool(torch.isclose(got.float(), base.float(), rtol=tol.rtol, atol=tol.atol, equal_nan=True).all())


def _disagreement(got: Any, want: torch.Tensor, tol: Any, baseline: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"is {type(got).__name__}, not a tensor"
    g = got.detach().to("cpu", torch.float64)
    w = want.detach().to("cpu", torch.float64)
    bad = ~torch.isclose(g, w, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    if not bool(bad.any()):
        return None
    b = baseline.detach().to("cpu", torch.float64)
    bad &= torch.isclose(b, w, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
    if not bool(bad.any()):
        return None
    error = (g - w).abs()[bad]
    worst = float(error.nan_to_num(math.inf).max())  # NaN where a number belongs counts as an infinite error
    index = tuple(int(i) for i in bad.nonzero()[0])
    return (
        f"{int(bad.sum())} of {bad.numel()} elements off the reference beyond the tolerance (atol={tol.atol}, "
        f"rtol={tol.rtol}); max abs error {worst:.3g}; first at {index}: got {g[index].item():.6g}, "
        f"expected {w[index].item():.6g}"
    )


def _compare_draws(op: Op, chosen: Provider, args: tuple[Any, ...], out: Any) -> str | None:
    from .sampling import acceptable_draws, allowed_tokens

    host = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    tokens = out.cpu()
    vocab = host[0].shape[1]
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        return f"drew ids outside the vocabulary [0, {vocab}): {tokens.tolist()[:16]}"
    if chosen.equivalence == "statistical":
        ok = allowed_tokens(*host[:4]).gather(1, tokens[:, None])[:, 0]
        rule = "tokens temperature/top-k/top-p allow"
    else:
        ok = acceptable_draws(*host).gather(1, tokens[:, None])[:, 0]
        rule = "the reference's draws from the same seeds"
    if bool(ok.all()):
        return None
    row = int((~ok).nonzero()[0])
    want = int(op.reference(*host)[row])
    return (
        f"drew token {int(tokens[row])} in row {row}, where the reference draws {want} "
        f"({int((~ok).sum())} of {len(tokens)} rows differ from {rule})"
    )


# -------------------------------------------------------------------------------------------------
# Reproducers: safetensors for the tensors, JSON for the rest (nothing is unpickled to replay one)
# -------------------------------------------------------------------------------------------------

_repro_counter = itertools.count()


def _arg_json(value: Any, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        name = f"arg{index}"
        tensors[name] = value.detach().to("cpu").contiguous()
        return {
            "tensor": name,
            "shape": list(value.shape),
            "stride": list(value.stride()),
            "storage_offset": value.storage_offset(),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return {"value": value}
    if isinstance(value, float):
        return {"float": repr(value)}  # repr round-trips exactly, nan and inf included
    return {"repr": repr(value)}


def write_repro(directory: Path, op: Op, chosen: Provider, context: Any, inputs: tuple[Any, ...], problem: str) -> Path:
    """Write ``inputs`` of a failing call as ``<op>-<provider>-<pid>-<n>.json`` + ``.safetensors``; return the JSON's path."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{op.name}-{chosen.name}-{os.getpid()}-{next(_repro_counter)}"
    tensors: dict[str, torch.Tensor] = {}
    args = [_arg_json(a, i, tensors) for i, a in enumerate(inputs)]
    save_file(tensors, str(directory / f"{stem}.safetensors"))
    path = directory / f"{stem}.json"
    record = {
        "format": REPRO_FORMAT,
        "op": op.name,
        "provider": chosen.name,
        "plugin": chosen.plugin,
        "platform": context.platform,
        "device_type": context.device_type,
        "dtype": str(context.dtype).removeprefix("torch."),
        "problem": problem,
        "args": args,
        "tensors": f"{stem}.safetensors",
        "command": f"vllm-port check-repro {path}",
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def _rebuild(spec: dict[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    if "tensor" in spec:
        data = tensors[spec["tensor"]].to(device)
        shape, stride, offset = spec["shape"], spec["stride"], spec["storage_offset"]
        overlapping = any(st == 0 and n > 1 for n, st in zip(shape, stride, strict=True))
        if overlapping or 0 in shape:
            return data.expand(shape) if overlapping else data
        size = offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1
        fill = math.nan if data.is_floating_point() else 0  # poison around the view: a read outside shows
        storage = torch.full((size,), fill, dtype=data.dtype, device=device)
        view = storage.as_strided(shape, stride, offset)
        view.copy_(data)
        return view
    if "float" in spec:
        return float(spec["float"])
    if "repr" in spec:
        raise SelectionError(f"reproducer argument {spec['repr']} cannot be rebuilt from JSON")
    return spec["value"]


def load_repro(path: str | os.PathLike[str], device: torch.device) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The record and the rebuilt arguments (views keep their strides and offsets) of a reproducer."""
    from safetensors.torch import load_file

    path = Path(path)
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("format") != REPRO_FORMAT:
        raise SelectionError(
            f"{path}: not a vllm-port reproducer (format {record.get('format')!r}, want {REPRO_FORMAT!r})"
        )
    tensors = load_file(str(path.parent / record["tensors"]))
    return record, tuple(_rebuild(spec, tensors, device) for spec in record["args"])


def replay(path: str | os.PathLike[str], provider: str | None = None) -> tuple[str | None, dict[str, Any]]:
    """Re-run a reproducer on this machine: ``(problem or None, record)``.

    Loads the plugins, selects the reproducer's platform, finds the provider it names (or
    ``provider``) and runs the same check as debug mode did.

    :raises SelectionError: when the platform or the provider is not installed here.
    """
    from ..runtime import load

    record = json.loads(Path(path).read_text(encoding="utf-8"))
    runtime = load(device=record.get("platform"))
    op = runtime.registry.ops.get(record.get("op", ""))
    if op is None:
        raise SelectionError(f"{path}: op {record.get('op')!r} is not an op of this vllm-port")
    name = provider or record["provider"]
    found = [p for p in runtime.registry.candidates(op.name, runtime.platform.name) if p.name == name]
    if not found:
        names = ", ".join(p.name for p in runtime.registry.candidates(op.name, runtime.platform.name))
        raise SelectionError(
            f"{path}: no provider {name!r} of op {op.name!r} on platform {runtime.platform.name!r}; candidates: {names}"
        )
    chosen = found[0]
    dtype = getattr(torch, record["dtype"])
    _, args = load_repro(path, runtime.device)
    mutated = [i for i, n in enumerate(op.signature.parameters) if n in op.mutates]
    before = {i: args[i].clone() for i in mutated}
    try:
        out = chosen.fn(*args)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}", {
            **record,
            "replayed": {"provider": chosen.name, "plugin": chosen.plugin},
        }
    problem = metadata_problem(op, args, out)
    if problem is None and chosen.name != "reference":
        problem = compare_with_reference(op, chosen, args, before, out, dtype)
    return problem, {**record, "replayed": {"provider": chosen.name, "plugin": chosen.plugin}}


def replay_command(path: str, provider: str | None = None) -> int:
    """``vllm-port check-repro FILE``: 1 when the fault reproduces, 0 when the call now agrees, 2 when it cannot run."""
    import sys

    from ..errors import VllmPortError

    try:
        problem, record = replay(path, provider)
    except (OSError, ValueError, KeyError, VllmPortError) as exc:
        print(f"error: cannot replay {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    ran = record["replayed"]
    what = f"op {record['op']!r}, {ran['provider']!r} of plugin {ran['plugin']!r}, {record['dtype']} on {record['platform']!r}"
    print(f"recorded: {record['problem']}")
    if problem:
        print(f"reproduced ({what}): {problem}")
        return 1
    print(f"not reproduced ({what}): the call agrees with the reference now")
    return 0
