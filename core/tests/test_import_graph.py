"""Core's modules stand in floors: no two of them import each other, however indirectly.

The graph counts every import a reader sees, not only those Python runs at import time: module
level, inside functions, and under ``if TYPE_CHECKING:``. Where two files import each other, one
of them is on the wrong floor: move the shared name one floor down.

Edges: ``import a.b`` and ``from a import b`` (``b`` a submodule) point at module ``a.b``;
``from a import name`` (``name`` not a submodule) points at package ``a``'s ``__init__``.
Relative imports resolve against the importing module's package.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

CORE_SRC = Path(__file__).resolve().parents[1] / "src"

#: module -> {imported module: the first line that imports it}
Graph = dict[str, dict[str, int]]


def module_names(root: Path) -> dict[str, Path]:
    """Every module under ``root``, by dotted name (a package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The dotted names ``node`` imports, relative ones resolved; ``from a import b`` yields ``a`` and ``a.b``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module an imported dotted name lands in: itself, else its nearest enclosing module of the tree."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path) -> Graph:
    """Every import of every module under ``root`` (module level, in functions, under TYPE_CHECKING)."""
    modules = module_names(root)
    graph: Graph = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = list(_imported(node, name, path.name == "__init__.py"))
            if isinstance(node, ast.ImportFrom):
                base, *members = names  # a member that is a submodule stands for itself, not for the package
                submodules = [m for m in members if m in modules]
                names = submodules if len(submodules) == len(members) else [base, *submodules]
            for imported in names:
                target = _target(imported, modules)
                if target is not None and target != name:
                    graph[name].setdefault(target, node.lineno)
    return graph


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe(component: list[str], graph: Graph, modules: dict[str, Path], root: Path) -> str:
    """One circle's modules and the imports that join them, each with its file and line."""
    inside = set(component)
    lines = [f"{len(component)} modules import each other: {', '.join(component)}"]
    for module in component:
        for target, line in sorted(graph[module].items()):
            if target in inside:
                lines.append(f"  {module} -> {target}  ({modules[module].relative_to(root)}:{line})")
    return "\n".join(lines)


def test_core_has_no_import_circle() -> None:
    graph = import_graph(CORE_SRC)
    assert len(graph) > 100 and "vllm_port.ops._registry" in graph  # the tree was found, not an empty folder
    modules = module_names(CORE_SRC)
    found = [describe(c, graph, modules, CORE_SRC) for c in circles(graph)]
    assert not found, "import circles in core (move the shared name one floor down):\n" + "\n".join(found)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_imports_in_functions_and_under_type_checking_close_a_circle(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from .low import thing\n",
            "pkg/low.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from .high import Other
                thing = 1
            """,
            "pkg/high.py": "def f():\n    from pkg import low\n",
            "pkg/side.py": "def g():\n    from . import high\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/deep.py": "from ..side import g\n",
        },
    )
    graph = import_graph(root)
    assert graph["pkg.high"] == {"pkg.low": 2}  # a submodule named in from-import is an edge to it, not the package
    assert graph["pkg.side"] == {"pkg.high": 2} and graph["pkg.sub.deep"] == {"pkg.side": 1}
    assert circles(graph) == [["pkg.high", "pkg.low"]]
    message = describe(circles(graph)[0], graph, module_names(root), root)
    assert "pkg.low -> pkg.high  (pkg/low.py:4)" in message and "pkg.high -> pkg.low  (pkg/high.py:2)" in message


def test_a_name_from_a_package_is_an_edge_to_its_init(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from .a import A\nfrom .b import B\n",
            "pkg/a.py": "A = 1\n",
            "pkg/b.py": "from pkg import A\nB = A\n",  # runs pkg/__init__, which imports b: a circle
            "pkg/c.py": "import pkg.a\nfrom pkg import a, b\n",
        },
    )
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg": 1} and graph["pkg.c"] == {"pkg.a": 1, "pkg.b": 2}
    assert circles(graph) == [["pkg", "pkg.b"]]
