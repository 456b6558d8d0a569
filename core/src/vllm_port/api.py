"""The contract's API version and the version ranges plugins declare.

Core exports :data:`API_VERSION` (``MAJOR.MINOR``). A plugin answers ``vllm_port_api_range`` with a
comma-separated list of clauses such as ``">=1.0,<2"``; each clause is one of ``==``, ``!=``, ``>=``,
``<=``, ``>``, ``<`` followed by ``MAJOR[.MINOR]``. A minor version adds to the contract, a major
version changes it.

History: 1.0 the platform, ops, memory and comm hooks; 1.1 adds optional hooks: compilation
(``vllm_port_graph_passes``, ``vllm_port_compile_backend``) and the reclaimer
(``vllm_port_reclaimer``). A plugin that implements a 1.1 hook declares ``">=1.1,<2"``; plugins of
``">=1.0,<2"`` keep loading unchanged.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable

__all__ = ["API_VERSION", "ENTRY_POINT_GROUP", "ApiRange"]

API_VERSION = "1.1"
#: The entry-point group a plugin distribution registers its plugin module under (``[project.entry-points.vllm_port]``).
ENTRY_POINT_GROUP = "vllm_port"

_CLAUSE = re.compile(r"^\s*(==|!=|>=|<=|>|<)\s*(\d+)(?:\.(\d+))?\s*$")
_COMPARE: dict[str, Callable[[tuple[int, int], tuple[int, int]], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}


def _parse_version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor or 0)


class ApiRange:
    """A parsed range of contract API versions, e.g. ``ApiRange(">=1.0,<2")``."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"an API range must be a non-empty string such as '>=1.0,<2', got {text!r}")
        self.text = text
        self._clauses: list[tuple[str, tuple[int, int]]] = []
        for clause in text.split(","):
            match = _CLAUSE.match(clause)
            if match is None:
                raise ValueError(
                    f"cannot parse API range clause {clause.strip()!r} in {text!r}; "
                    "write clauses like '>=1.0' or '<2' separated by commas"
                )
            op, major, minor = match.groups()
            self._clauses.append((op, (int(major), int(minor or 0))))

    def __contains__(self, version: str) -> bool:
        parsed = _parse_version(version)
        return all(_COMPARE[op](parsed, bound) for op, bound in self._clauses)

    def __repr__(self) -> str:
        return f"ApiRange({self.text!r})"
