"""The contract's vocabulary for graph rewrites: :class:`GraphPass` and the :class:`PassContext` it runs in.

A plugin contributes passes through the ``vllm_port_graph_passes`` hook (:mod:`vllm_port.hookspecs`);
core's own fusions and the machinery that runs them live in :mod:`vllm_port.flat.passes`, which
re-exports both names (``from vllm_port.flat import GraphPass`` keeps working). They stand here, on
the ground floor beside the hook specs, so that the contract does not import the flat graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.fx as fx

__all__ = ["GraphPass", "PassContext"]


@dataclass(frozen=True)
class PassContext:
    """What a pass may use besides the graph.

    Attributes:
        ops: contract op name -> the custom op a new node calls (the providers bound for this
            platform and dtype; see :func:`vllm_port.flat.flat_graph.op_targets`).
        platform: the platform's name.
        dtype: the dtype the ops were bound for.
    """

    ops: Mapping[str, Any]
    platform: str = ""
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class GraphPass:
    """A rewrite of flat graphs: ``fn(module, context) -> times fired``.

    Attributes:
        name: how the fusion is reported (``vllm-port inspect``, ``FlatGraph.fusions``).
        fn: rewrites ``module.graph`` in place and returns how many times it fired (0: untouched).
        plugin: who contributed it (set by core for plugin passes).
    """

    name: str
    fn: Callable[[fx.GraphModule, PassContext], int]
    plugin: str = field(default="vllm-port", compare=False)
