"""Providers as ``torch.library`` custom ops, so ``torch.compile(fullgraph=True)`` traces each op as one node.

Each provider becomes its own op, ``vllm_port::<op>__<plugin>__<provider>``, with the schema of the
op reference, the op's mutated arguments and the op's fake implementation. Eager code does not
need the wrapper (it costs tens of microseconds per call on CPU, see docs/results/dispatch-cpu.md);
``Runtime.bind(dtype, traceable=True)`` hands it out for compiled models (:func:`as_custom_ops`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from ._op import Op
from ._provider import Provider
from ._registry import BoundOps

__all__ = ["as_custom_op", "as_custom_ops"]

_LIBRARY = "vllm_port"
_made: dict[str, Callable[..., Any]] = {}


def _ident(text: str) -> str:
    return re.sub(r"\W", "_", text)


def as_custom_op(op: Op, provider: Provider) -> Callable[..., Any]:
    """The custom op that runs ``provider`` (made once per process and reused)."""
    qualname = f"{_LIBRARY}::{op.name}__{_ident(provider.plugin)}__{_ident(provider.name)}"
    if getattr(provider.fn, "vllm_port_counted", False):  # VLLM_PORT_STATS: a custom op of its own
        qualname += "__counted"
    if qualname not in _made:
        if op.fake is None:
            raise ValueError(f"op {op.name!r} has no fake implementation, so it cannot be traced; give the Op a fake")
        schema = torch.library.infer_schema(op.reference, mutates_args=op.mutates)
        custom = torch.library.custom_op(qualname, provider.fn, mutates_args=op.mutates, schema=schema)
        custom.register_fake(op.fake)
        _made[qualname] = custom
    return _made[qualname]


def as_custom_ops(kernels: BoundOps, ops: Mapping[str, Op]) -> BoundOps:
    """``kernels`` with every chosen provider called through its custom op; what binding recorded is kept."""
    chosen = {name: replace(p, fn=as_custom_op(ops[name], p)) for name, p in kernels.providers.items()}
    return BoundOps(
        kernels.context, chosen, candidates=kernels.candidates, skipped=kernels.skipped, fallbacks=kernels.fallbacks
    )
