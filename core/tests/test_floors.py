"""Every import of core points at its own floor or below, as ``docs/floors.md`` draws them.

The floors are read from the page's table, so the page a newcomer reads first is the tree as it
stands: a module the table does not place, or an import that climbs, fails here with the line that
does it and the floors of both ends.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

from test_import_graph import CORE_SRC, Graph, import_graph, module_names

FLOORS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "floors.md"
VENDOR_PLUGINS = ("vllm_port_cpu", "vllm_port_cuda", "vllm_port_rocm", "vllm_port_xpu")
SUITE = "vllm_port_conformance"
#: the modules that may import the conformance suite: the command that certifies (the scaffold only writes its name in templates)
SUITE_USERS = {"vllm_port.certify_command"}

#: A row of the floors table: ``| 3 | what | `flat`, `flat.*` |``.
_ROW = re.compile(r"^\|\s*(\d+)\s*\|[^|]*\|(?P<modules>[^|]*)\|\s*$")


def floor_patterns(page: Path) -> dict[str, int]:
    """The page's table as ``{pattern: floor}``; patterns are dotted names without ``vllm_port.``."""
    patterns: dict[str, int] = {}
    for line in page.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            for pattern in re.findall(r"`([^`]+)`", match["modules"]):
                assert pattern not in patterns, f"{page.name}: {pattern!r} is on two floors"
                patterns[pattern] = int(match[1])
    return patterns


def floor_of(module: str, patterns: dict[str, int]) -> int | None:
    """The floor of a core module: its exact name's, else the longest pattern's that matches it."""
    name = module.removeprefix("vllm_port.") if module != "vllm_port" else module
    if name in patterns:
        return patterns[name]
    matches = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
    return patterns[max(matches, key=len)] if matches else None


def climbing_imports(graph: Graph, patterns: dict[str, int]) -> list[str]:
    """Each import from a module to one on a higher floor, as ``a (floor) -> b (floor), line N``."""
    found = []
    for module, targets in sorted(graph.items()):
        here = floor_of(module, patterns)
        for target, line in sorted(targets.items()):
            there = floor_of(target, patterns)
            if here is not None and there is not None and there > here:
                found.append(f"{module} (floor {here}) -> {target} (floor {there}), line {line}")
    return found


def test_every_module_of_core_has_a_floor() -> None:
    patterns = floor_patterns(FLOORS_PAGE)
    assert len(set(patterns.values())) >= 7, patterns  # the table was read, not an empty page
    unplaced = [m for m in module_names(CORE_SRC) if floor_of(m, patterns) is None]
    assert not unplaced, f"modules docs/floors.md does not place (add them to its table): {unplaced}"


def test_no_import_climbs_a_floor() -> None:
    patterns = floor_patterns(FLOORS_PAGE)
    found = climbing_imports(import_graph(CORE_SRC), patterns)
    assert not found, "imports that climb (move the shared name down, or the module up):\n" + "\n".join(found)


def _top_level_imports(path: Path) -> set[str]:
    """The top-level packages a module imports (every import statement; strings such as templates are not imports)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_never_imports_a_vendor_plugin_and_only_certify_runs_the_suite() -> None:
    plugins, suite = {}, []
    for name, path in module_names(CORE_SRC).items():
        imported = _top_level_imports(path)
        if imported & set(VENDOR_PLUGINS):
            plugins[name] = sorted(imported & set(VENDOR_PLUGINS))
        if SUITE in imported and name not in SUITE_USERS:
            suite.append(name)
    assert not plugins, f"core modules that import a vendor plugin: {plugins}"
    assert not suite, f"core modules other than {sorted(SUITE_USERS)} that import the conformance suite: {suite}"


def test_the_floor_rules_see_a_climb_and_the_most_specific_line(tmp_path: Path) -> None:
    page = tmp_path / "floors.md"
    page.write_text(
        "| floor | what | modules |\n| --- | --- | --- |\n"
        "| 2 | top | `engine`, `engine.*` |\n| 3 | commands | `engine.command` |\n| 0 | ground | `errors` |\n",
        encoding="utf-8",
    )
    patterns = floor_patterns(page)
    assert floor_of("vllm_port.engine.command", patterns) == 3 and floor_of("vllm_port.engine.llm", patterns) == 2
    assert floor_of("vllm_port.unplaced", patterns) is None
    graph = {"vllm_port.errors": {"vllm_port.engine.llm": 7}, "vllm_port.engine.command": {"vllm_port.engine": 1}}
    assert climbing_imports(graph, patterns) == ["vllm_port.errors (floor 0) -> vllm_port.engine.llm (floor 2), line 7"]
