"""The registry that checks providers, and binding: each op resolved once to one function.

Registration refuses a provider whose signature differs from the op's reference. Binding picks,
for one platform and dtype, the supported provider of highest priority for every op, with the
reference last. The result, :class:`BoundOps`, holds the chosen functions as plain attributes:
calling ``kernels.rms_norm(...)`` is one attribute load and a call, nothing more.

Where binding falls back on its own (a candidate whose support predicate raises, one that fails its
smoke check, :mod:`vllm_port.ops._smoke`, or was quarantined in this process, the reference serving
an op the platform's providers do not cover), it records why in ``BoundOps.skipped`` and
``BoundOps.fallbacks``; strict mode (:mod:`vllm_port.faults`) refuses instead.

The registry only resolves. What the chosen functions are wrapped in is decided where binding is
(``Runtime.bind``): custom ops for ``torch.compile`` (:mod:`vllm_port.ops._custom`), or debug
mode's checking wrappers (:mod:`vllm_port.ops.debug`), which quarantine a provider found at fault
in the table kept here, so that no later bind of this process chooses it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch

from ..errors import ProviderError, ProviderRejectedError, SelectionError
from ..faults import fall_back, strict_mode
from ._op import Op
from ._provider import ANY_PLATFORM, FLOAT_DTYPES, REFERENCE, BindContext, Provider, provider, who
from ._smoke import smoke_check

__all__ = [
    "FLOAT_DTYPES",
    "REFERENCE",
    "BindContext",
    "BoundOps",
    "OpRegistry",
    "Provider",
    "clear_quarantine",
    "provider",
    "quarantine",
    "quarantined",
]

_REFERENCE_PRIORITY = -(2**31)


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
                    op.name, REFERENCE, op.reference, _REFERENCE_PRIORITY, op.dtypes, None, ANY_PLATFORM, "vllm-port"
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
        named = f"provider {candidate.name!r} of plugin {plugin!r}"
        op = self.ops.get(candidate.op)
        if op is None:
            raise ProviderRejectedError(
                f"{named} is for op {candidate.op!r}, which the contract does not define; ops: {', '.join(sorted(self.ops))}"
            )
        _check_signature(named, op, candidate.fn)
        if not candidate.dtypes or not candidate.dtypes <= op.dtypes:
            raise ProviderRejectedError(
                f"{named} claims dtypes {sorted(map(str, candidate.dtypes))}; op {op.name!r} is defined for {sorted(map(str, op.dtypes))}"
            )
        registered = replace(candidate, plugin=plugin, platform=candidate.platform or platform)
        if any(p.name == registered.name and p.platform == registered.platform for p in self._providers[op.name]):
            raise ProviderRejectedError(
                f"{named}: op {op.name!r} already has a provider named {candidate.name!r} on platform "
                f"{registered.platform!r}; pick a unique name"
            )
        self._providers[op.name].append(registered)
        return registered

    def candidates(self, op: str, platform: str | None = None) -> list[Provider]:
        """Providers of ``op`` (for ``platform``, or all), highest priority first, the reference last."""
        found = [p for p in self._providers[op] if platform is None or p.platform in (platform, ANY_PLATFORM)]
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
        *,
        verify_on: torch.device | None = None,
        strict: bool | None = None,
    ) -> BoundOps:
        """Resolve every op once for ``ctx``.

        :param prefer: op name -> provider name that must serve it.
        :param verify_on: smoke-check candidates on this device, on their op's small samples
            (:func:`~vllm_port.ops._smoke.smoke_check`), best first, skipping those that fail, until one
            passes; a preferred provider that fails is an error. ``None``: no smoke checks.
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
        chosen: dict[str, Provider] = {}
        candidates: dict[str, list[Provider]] = {}
        skipped: dict[str, list[tuple[Provider, str]]] = {}
        fallbacks: list[str] = []
        for name, op in self.ops.items():
            found = self._choose(op, ctx, prefer.get(name), verify_on, strict, skipped, fallbacks)
            chosen[name], candidates[name] = found[0], found
        return BoundOps(ctx, chosen, candidates=candidates, skipped=skipped, fallbacks=fallbacks)

    def _choose(
        self,
        op: Op,
        ctx: BindContext,
        prefer: str | None,
        verify_on: torch.device | None,
        strict: bool,
        skipped: dict[str, list[tuple[Provider, str]]],
        fallbacks: list[str],
    ) -> list[Provider]:
        """The providers that may serve ``op`` in ``ctx``, the chosen one first; records what was passed over."""
        if prefer is not None:
            named = self.resolve(op.name, ctx, prefer)
            problem = smoke_check(op, named, ctx.dtype, verify_on) if verify_on is not None else None
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
                check_it = verify_on is not None and not supported
                reason = (
                    quarantined(candidate) or (check_it and smoke_check(op, candidate, ctx.dtype, verify_on)) or None
                )
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


# -------------------------------------------------------------------------------------------------
# Quarantine: providers found faulty in this process (by debug mode), which no later bind chooses
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


def _check_signature(named: str, op: Op, fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise ProviderRejectedError(f"{named}: fn is {fn!r}, not a function")
    try:
        got = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise ProviderRejectedError(f"{named}: cannot read its signature ({exc})") from exc
    try:  # resolve string annotations only for a readable message; they are not compared
        got = inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: S110 - annotations naming TYPE_CHECKING-only types stay strings
        pass
    want = op.signature
    shape = [(p.name, p.kind, p.default) for p in got.parameters.values()]
    if shape != [(p.name, p.kind, p.default) for p in want.parameters.values()]:
        raise ProviderRejectedError(
            f"{named} has signature {op.name}{got}, but op {op.name!r} is {op.name}{want}; "
            "use the same parameter names, kinds and defaults as the reference"
        )
