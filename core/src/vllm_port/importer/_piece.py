"""A piece under rewrite, and what the rewrite reports of it: the importer's shared types.

They stand below the modules that use them (``_rewrite``, ``_rotary``, ``imported_model``), so the
rewriter and its pattern modules never import each other both ways.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Mapped", "PieceReport", "RewriteSite"]


@dataclass(frozen=True)
class Mapped:
    """One recognised subgraph: what it computes, the contract ops that now compute it, the nodes it replaced."""

    piece: str
    pattern: str
    ops: tuple[str, ...]
    replaced: tuple[str, ...]
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "piece": self.piece,
            "pattern": self.pattern,
            "ops": list(self.ops),
            "replaced": list(self.replaced),
            "detail": self.detail,
        }


@dataclass
class PieceReport:
    """A piece after the rewrite: its recognised subgraphs, and its nodes that stay native torch (views apart).

    ``native`` entries are ``{"piece", "node", "op"}``; a dtype cast adds ``"cast": "float32 -> bfloat16"``.
    ``views`` counts the layout nodes (and casts to the dtype a tensor already has).
    """

    piece: str
    mapped: list[Mapped] = field(default_factory=list)
    native: list[dict[str, str]] = field(default_factory=list)
    views: int = 0
    notes: list[str] = field(default_factory=list)


class RewriteSite:
    """One piece under rewrite: its module and graph, its tensors' names, the inputs the rewrite
    added and the report; with the helpers every pattern uses (the rewriter in ``_rewrite`` and the
    pattern modules beside it, such as ``_rotary``, work on one).
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        piece: str,
        names: Mapping[int, str],
        rotary_table: torch.Tensor | None,
        inputs: dict[str, fx.Node],
        who: str,
    ) -> None:
        self.gm, self.graph, self.piece, self.names, self.who = gm, gm.graph, piece, names, who
        self.rotary_table = rotary_table
        self.inputs = inputs  # added placeholders: ops, positions, key_cache, value_cache, meta
        self.report = PieceReport(piece)
        self._fresh_attr = 0

    def order(self) -> dict[fx.Node, int]:
        """Each node's position in the graph now."""
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def attr(self, node: Any) -> torch.Tensor | None:
        """The tensor a ``get_attr`` node reads (a weight, a buffer), else ``None``."""
        if isinstance(node, fx.Node) and node.op == "get_attr":
            value = getattr(self.gm, str(node.target), None)
            return value if isinstance(value, torch.Tensor) else None
        return None

    def name(self, node: fx.Node) -> str:
        """The model's name for the tensor ``node`` reads (its state-dict key), else the node's own name."""
        tensor = self.attr(node)
        return self.names.get(id(tensor), str(node.target)) if tensor is not None else node.name

    def new_attr(self, tensor: torch.Tensor, name: str) -> fx.Node:
        """A ``get_attr`` node of a new buffer holding ``tensor``, reported under ``name``."""
        self._fresh_attr += 1
        target = f"_imported_{self._fresh_attr}"
        self.gm.register_buffer(target, tensor, persistent=True)
        self.names = {**self.names, id(tensor): name}
        return self.graph.get_attr(target)

    def map(self, pattern: str, ops: tuple[str, ...], nodes: list[fx.Node], detail: str) -> None:
        """Report that ``nodes`` matched ``pattern`` and ``ops`` now compute it."""
        self.report.mapped.append(Mapped(self.piece, pattern, ops, tuple(n.name for n in nodes), detail))

    @staticmethod
    def only_read_by(node: fx.Node, allowed: set[fx.Node]) -> bool:
        """Whether every reader of ``node`` is in ``allowed``."""
        return set(node.users) <= allowed
