"""Views and in-place writes in an fx graph, read from the ops' schemas: what placement must keep together.

A view (``view``, ``split``, a ``getitem`` of a split) shares its input's storage, so it moves no
data and runs where that storage lives; an op that writes an argument in place (``reshape_and_cache``
its caches, ``rotary_embedding`` query and key, ``fused_add_rms_norm`` the residual) changes every view of it. These predicates tell both.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["aliased_input", "is_tensor", "is_tensor_list", "written_args"]


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input ``node``'s output is a view of (``view``, ``split``, ``getitem`` of a split), else ``None``."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        base = node.args[0]
        return base if isinstance(base, fx.Node) and is_tensor_list(base) else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(r.alias_info is not None for r in schema.returns):
        return None
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and not info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            return value if isinstance(value, fx.Node) else None
    return None


def is_tensor(node: Any) -> bool:
    """``node`` is an fx node whose value is a tensor (not a size, an int or a list)."""
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def is_tensor_list(node: fx.Node) -> bool:
    """``node``'s value is a non-empty list of tensors (what ``split`` returns)."""
    val = node.meta.get("val")
    return isinstance(val, (list, tuple)) and bool(val) and all(isinstance(v, torch.Tensor) for v in val)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments ``node``'s op writes in place, by its schema (none for an op without one)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                written.append(value)
    return written
