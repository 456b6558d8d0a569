"""Providers: implementations of an op, each with a name, a priority and what it supports.

A provider is a function that honours an op's contract (its signature is the op reference's). The
registry (:mod:`vllm_port.ops._registry`) checks providers as plugins register them and resolves
each op to one of them when it binds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["ANY_PLATFORM", "FLOAT_DTYPES", "REFERENCE", "BindContext", "Provider", "provider", "who"]

#: The name of the reference provider every op has.
REFERENCE = "reference"
FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})
#: The platform of a provider that runs everywhere (the reference).
ANY_PLATFORM = "*"


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
        if self.platform not in (ctx.platform, ANY_PLATFORM) or ctx.dtype not in self.dtypes:
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


def who(provider: Provider) -> str:
    """``"provider 'x' of plugin 'y'"``: how every message names a provider."""
    return f"provider {provider.name!r} of plugin {provider.plugin!r}"
