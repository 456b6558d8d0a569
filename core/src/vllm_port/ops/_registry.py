"""Providers, the registry that checks them, and binding: each op resolved once to one function.

A provider is a function that honours an op's contract, with a name, a priority and a support
predicate. Registration refuses a provider whose signature differs from the op's reference.
Binding picks, for one platform and dtype, the supported provider of highest priority for every
op, with the reference last. The result, :class:`BoundOps`, holds the chosen functions as plain
attributes: calling ``kernels.rms_norm(...)`` is one attribute load and a call, nothing more.

Where binding falls back on its own (a candidate whose support predicate raises, one that fails its
smoke check under ``verify=True`` or was quarantined in this process, the reference serving an op
the platform's providers do not cover), it records why in ``BoundOps.skipped`` and
``BoundOps.fallbacks``; strict mode (:mod:`vllm_port.faults`) refuses instead. Debug mode
(``check=``, :mod:`vllm_port.ops.debug`) binds checking wrappers in place of the bare functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..errors import ProviderError, ProviderRejectedError, SelectionError
from ..faults import fall_back, strict_mode
from ._op import Op

if TYPE_CHECKING:
    from .debug import CheckConfig

__all__ = ["FLOAT_DTYPES", "REFERENCE", "BindContext", "BoundOps", "OpRegistry", "Provider", "provider"]

#: The name of the reference provider every op has.
REFERENCE = "reference"
FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
_REFERENCE_PRIORITY = -(2**31)
_ANY_PLATFORM = "*"


@dataclass(frozen=True)
class BindContext:
    """What binding knows when it asks a provider whether it supports the run ahead."""

    platform: str
    device_type: str
    dtype: torch.dtype
    capabilities: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Provider:
    """An implementation of one op.

    Attributes:
        op: the op's name.
        name: the provider's name, unique per op (``"cpu_rms_norm"``, ``"triton_rms_norm"``).
        fn: the implementation; its signature must equal the op reference's.
        priority: higher is preferred; the reference has the lowest possible.
        dtypes: the dtypes it claims; conformance checks each claim.
        supports: optional predicate on the bind context (capabilities, platform) for finer limits.
        platform: the platform it runs on; by default the registering plugin's platform.
        plugin: the plugin that registered it (set by the registry).
        equivalence: for an op whose outputs are random draws (``sample``), how conformance
            compares them with the reference's: ``"bitwise"`` (the default) reproduces the
            reference's draws from the per-request seeds; ``"statistical"`` (a sampler with the
            device's own generator) draws from the reference's distribution, checked by a
            goodness-of-fit test, and must still be reproducible per request seed. See
            :mod:`vllm_port.ops.sampling`. Ops with deterministic outputs ignore it.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    priority: int = 0
    dtypes: frozenset[torch.dtype] = FLOAT_DTYPES
    supports: Callable[[BindContext], bool] | None = None
    platform: str = ""
    plugin: str = ""
    equivalence: Literal["bitwise", "statistical"] = "bitwise"

    def is_supported(self, ctx: BindContext) -> bool:
        """Whether this provider can serve the bind context (platform, dtype, predicate)."""
        if self.platform not in (ctx.platform, _ANY_PLATFORM) or ctx.dtype not in self.dtypes:
            return False
        return self.supports is None or bool(self.supports(ctx))


def provider(
    op: str,
    *,
    name: str | None = None,
    priority: int = 0,
    dtypes: Iterable[torch.dtype] = FLOAT_DTYPES,
    supports: Callable[[BindContext], bool] | None = None,
) -> Callable[[Callable[..., Any]], Provider]:
    """Decorator that turns a function into a :class:`Provider` of ``op`` (named after the function)."""

    def wrap(fn: Callable[..., Any]) -> Provider:
        return Provider(op, name or fn.__name__, fn, priority, frozenset(dtypes), supports)

    return wrap


class BoundOps:
    """The ops bound for one platform and dtype: ``kernels.rms_norm(x, w, eps)`` calls the chosen provider.

    Attributes:
        context: the platform, device type, dtype and capabilities bound for.
        providers: op -> the provider serving it (after a quarantine in debug mode: the one serving now).
        candidates: op -> the supported providers from the chosen one on, in the order binding tried them.
        skipped: op -> ``(provider, reason)`` for each candidate passed over (failed check, quarantine).
        fallbacks: every fallback binding took, one sentence each (what strict mode refuses).
    """

    def __init__(
        self,
        ctx: BindContext,
        providers: Mapping[str, Provider],
        *,
        candidates: Mapping[str, list[Provider]] | None = None,
        skipped: Mapping[str, list[tuple[Provider, str]]] | None = None,
        fallbacks: list[str] | None = None,
    ) -> None:
        self.context = ctx
        self.providers = dict(providers)
        self.candidates = dict(candidates or {})
        self.skipped = {op: list(found) for op, found in (skipped or {}).items()}
        self.fallbacks = list(fallbacks or [])
        for op_name, chosen in providers.items():
            setattr(self, op_name, chosen.fn)

    def __getattr__(self, name: str) -> Any:  # only reached for names that are not bound ops
        raise AttributeError(f"no op named {name!r} is bound; bound ops: {', '.join(sorted(self.providers))}")

    def __repr__(self) -> str:
        chosen = ", ".join(f"{op}={p.name}" for op, p in sorted(self.providers.items()))
        return f"BoundOps({self.context.platform}, {self.context.dtype}: {chosen})"


class OpRegistry:
    """Every op of the contract and every provider plugins registered for them."""

    def __init__(self, ops: Iterable[Op]) -> None:
        self.ops: dict[str, Op] = {op.name: op for op in ops}
        self._providers: dict[str, list[Provider]] = {
            op.name: [
                Provider(
                    op.name, REFERENCE, op.reference, _REFERENCE_PRIORITY, op.dtypes, None, _ANY_PLATFORM, "vllm-port"
                )
            ]
            for op in self.ops.values()
        }

    def register(self, candidate: Any, *, plugin: str, platform: str) -> Provider:
        """Check ``candidate`` against its op's contract and add it; raise ``ProviderRejectedError`` if it breaks it."""
        if not isinstance(candidate, Provider):
            raise ProviderRejectedError(
                f"plugin {plugin!r} returned {candidate!r} from vllm_port_providers; return Provider objects "
                "(see vllm_port.ops.provider)"
            )
        who = f"provider {candidate.name!r} of plugin {plugin!r}"
        op = self.ops.get(candidate.op)
        if op is None:
            raise ProviderRejectedError(
                f"{who} is for op {candidate.op!r}, which the contract does not define; ops: {', '.join(sorted(self.ops))}"
            )
        _check_signature(who, op, candidate.fn)
        if not candidate.dtypes or not candidate.dtypes <= op.dtypes:
            raise ProviderRejectedError(
                f"{who} claims dtypes {sorted(map(str, candidate.dtypes))}; op {op.name!r} is defined for {sorted(map(str, op.dtypes))}"
            )
        registered = replace(candidate, plugin=plugin, platform=candidate.platform or platform)
        if any(p.name == registered.name and p.platform == registered.platform for p in self._providers[op.name]):
            raise ProviderRejectedError(
                f"{who}: op {op.name!r} already has a provider named {candidate.name!r} on platform "
                f"{registered.platform!r}; pick a unique name"
            )
        self._providers[op.name].append(registered)
        return registered

    def candidates(self, op: str, platform: str | None = None) -> list[Provider]:
        """Providers of ``op`` (for ``platform``, or all), highest priority first, the reference last."""
        found = [p for p in self._providers[op] if platform is None or p.platform in (platform, _ANY_PLATFORM)]
        return sorted(found, key=lambda p: -p.priority)

    def resolve(self, op: str, ctx: BindContext, prefer: str | None = None) -> Provider:
        """The provider that serves ``op`` in ``ctx``: ``prefer`` if named, else the best supported one."""
        candidates = self.candidates(op, ctx.platform)
        if prefer is not None:
            named = [p for p in candidates if p.name == prefer]
            if not named:
                names = ", ".join(p.name for p in candidates)
                raise SelectionError(
                    f"op {op!r} has no provider named {prefer!r} on platform {ctx.platform!r}; candidates: {names}"
                )
            if not named[0].is_supported(ctx):
                raise SelectionError(
                    f"provider {prefer!r} of op {op!r} does not support {ctx.dtype} on {ctx.platform!r}"
                )
            return named[0]
        return next(p for p in candidates if p.is_supported(ctx))  # the reference supports every op dtype

    def bind(
        self,
        ctx: BindContext,
        prefer: Mapping[str, str] | None = None,
        traceable: bool = False,
        *,
        verify: bool = False,
        check: CheckConfig | None = None,
        device: torch.device | None = None,
        strict: bool | None = None,
    ) -> BoundOps:
        """Resolve every op once for ``ctx``.

        :param prefer: op name -> provider name that must serve it.
        :param traceable: bind each provider as a ``torch.library`` custom op, so that
            ``torch.compile(fullgraph=True)`` traces it as one node; eager callers leave it off.
        :param verify: smoke-check candidates on their op's small samples (:func:`~vllm_port.ops.debug.smoke_check`),
            best first, skipping those that fail, until one passes; a preferred provider that fails is an error.
        :param check: debug mode's settings: bind :class:`~vllm_port.ops.debug.CheckedOp` wrappers (eager only).
        :param device: where smoke checks run (default: the context's device type).
        :param strict: refuse every fallback (``VLLM_PORT_STRICT`` when ``None``).
        :raises StrictModeError: in strict mode, at the first fallback.
        """
        prefer = dict(prefer or {})
        unknown = set(prefer) - set(self.ops)
        if unknown:
            raise SelectionError(
                f"provider preferences name unknown ops {sorted(unknown)}; ops: {', '.join(sorted(self.ops))}"
            )
        strict = strict_mode(strict)
        device = device if device is not None else torch.device(ctx.device_type)
        chosen: dict[str, Provider] = {}
        candidates: dict[str, list[Provider]] = {}
        skipped: dict[str, list[tuple[Provider, str]]] = {}
        fallbacks: list[str] = []
        for name, op in self.ops.items():
            found = self._choose(op, ctx, prefer.get(name), verify, device, strict, skipped, fallbacks)
            chosen[name], candidates[name] = found[0], found
        if traceable:
            from ._custom import as_custom_op

            chosen = {name: replace(p, fn=as_custom_op(self.ops[name], p)) for name, p in chosen.items()}
        kernels = BoundOps(ctx, chosen, candidates=candidates, skipped=skipped, fallbacks=fallbacks)
        if check is not None and not traceable:  # a compiled graph calls the custom ops, never these wrappers
            from .debug import CheckedOp

            for name, op in self.ops.items():
                setattr(kernels, name, CheckedOp(op, kernels, candidates[name], check))
        return kernels

    def _choose(
        self,
        op: Op,
        ctx: BindContext,
        prefer: str | None,
        verify: bool,
        device: torch.device,
        strict: bool,
        skipped: dict[str, list[tuple[Provider, str]]],
        fallbacks: list[str],
    ) -> list[Provider]:
        """The providers that may serve ``op`` in ``ctx``, the chosen one first; records what was passed over."""
        from .debug import quarantined, smoke_check, who

        if prefer is not None:
            named = self.resolve(op.name, ctx, prefer)
            problem = smoke_check(op, named, ctx.dtype, device) if verify else None
            if problem:
                raise ProviderError(
                    f"op {op.name!r}: {who(named)}, named by the provider preferences, fails its smoke check {problem}; "
                    f"name another provider of op {op.name!r}",
                    op.name,
                    named.name,
                    named.plugin,
                )
            return [named]
        supported: list[Provider] = []
        for candidate in self.candidates(op.name, ctx.platform):
            try:
                reason = None if candidate.is_supported(ctx) else ""
            except Exception as exc:  # a plugin's predicate must not take binding down
                reason = f"its support predicate raised {type(exc).__name__}: {exc}"
            if reason is None:  # smoke checks stop at the first that passes: the rest are only fallbacks
                check_it = verify and not supported
                reason = quarantined(candidate) or (check_it and smoke_check(op, candidate, ctx.dtype, device)) or None
            if reason is None:
                supported.append(candidate)
            elif reason:
                skipped.setdefault(op.name, []).append((candidate, reason))
                fall_back(
                    f"op {op.name!r} ({ctx.dtype} on {ctx.platform!r}): {who(candidate)} was skipped: {reason}",
                    f"Fix the provider, or name another one for the op: VLLM_PORT_OP_PROVIDERS={op.name}=NAME",
                    strict=strict,
                    record=fallbacks,
                )
        if not supported:
            raise ProviderError(
                f"op {op.name!r}: no provider can serve {ctx.dtype} on {ctx.platform!r}: "
                + "; ".join(f"{who(p)}: {why}" for p, why in skipped.get(op.name, [])),
                op.name,
            )
        own = [p.name for p in self.candidates(op.name, ctx.platform) if p.name != REFERENCE]
        if supported[0].name == REFERENCE and own and op.name not in skipped:
            fall_back(
                f"op {op.name!r}: the reference serves {ctx.dtype} on {ctx.platform!r}, though the platform has "
                f"providers for it ({', '.join(own)}) that do not support this dtype or device",
                f"To run on the reference on purpose, say so: VLLM_PORT_OP_PROVIDERS={op.name}=reference",
                strict=strict,
                record=fallbacks,
            )
        return supported


def _check_signature(who: str, op: Op, fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise ProviderRejectedError(f"{who}: fn is {fn!r}, not a function")
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ProviderRejectedError(f"{who}: cannot read its signature ({exc})") from exc
    try:  # resolve string annotations only for a readable message; they are not compared
        got = inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: S110 - annotations naming TYPE_CHECKING-only types stay strings
        pass
    want = op.signature
    shape = [(p.name, p.kind, p.default) for p in got.parameters.values()]
    if shape != [(p.name, p.kind, p.default) for p in want.parameters.values()]:
        raise ProviderRejectedError(
            f"{who} has signature {op.name}{got}, but op {op.name!r} is {op.name}{want}; "
            "use the same parameter names, kinds and defaults as the reference"
        )
