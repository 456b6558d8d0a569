"""Every distribution imports only what it declares: each installs into a venv holding its declared dependencies alone, and loads.

Two checks. The first reads the sources: every import at a module's top level names the standard
library, the distribution's own packages, or a distribution its ``pyproject.toml`` declares (a
dependency or an extra). The second installs: one base venv gets core's wheel with the dependencies
pip resolves for it, torch (the pin of dev/requirements.txt) found installed in the session's torch
venv below it (``torch_venv``, shared with test_wheels.py); each other distribution gets a venv of its
own that sees the base's and the torch venv's site-packages through a ``.pth`` file (torch is
installed once) and installs the distribution's wheel with its declared dependencies resolved by
pip, never ``--no-deps``. In it every module of the distribution is
imported, ``vllm-port doctor --json`` loads each plugin without an error, and a GPU plugin's
``vllm-port certify`` says "device absent" (exit 2) on a machine without its device, the suite
installed after ``doctor`` ran (so its dependencies cannot hide a plugin's).

The vLLM bridge imports its host, vLLM, without declaring it (:data:`distributions.HOSTS`: vLLM comes
as several distributions, each with its own torch build); its venv loads every module but those that
import vLLM, and ``python -m vllm_port_vllm.compat`` says that vLLM is missing, without a traceback.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from distributions import DISTRIBUTIONS, HOSTS, REPO, WHEELS_GROUP, make_venv, torch_pin

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

#: modules a distribution ships that need one of its extras, with the extra (skipped where it is not installed)
NEEDS_EXTRA = {"vllm_port.kernels.triton": "triton", "vllm_port.serve": "serve"}
#: GPU plugins: certify must say the device is absent here, not that the plugin failed
GPU_PLUGINS = {"plugins/vllm-port-cuda": "cuda", "plugins/vllm-port-rocm": "rocm", "plugins/vllm-port-xpu": "xpu"}
pytestmark = pytest.mark.xdist_group(WHEELS_GROUP)  # one worker builds the wheels, for test_wheels.py too
IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
skip = sys.argv[2:]
failed, imported = {}, 0
for top in sys.argv[1].split(","):
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: None):
        if any(info.name == s or info.name.startswith(s + ".") for s in skip):
            continue
        try:
            importlib.import_module(info.name)
            imported += 1
        except Exception as exc:
            failed[info.name] = f"{type(exc).__name__}: {exc}"
print(json.dumps({"imported": imported, "failed": failed}))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(source: str) -> set[str]:
    """Distribution names (normalized) that ``source``'s pyproject.toml declares: dependencies and every extra."""
    project = tomllib.loads((REPO / source / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normal(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements}


def _top_level_imports(path: Path) -> set[str]:
    """Top-level names a module imports when it is imported: its body's own import statements (not those
    inside functions, ``if TYPE_CHECKING:`` or ``try: ... except ImportError``, which run on demand or are guarded)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.slow
@pytest.mark.parametrize("source", sorted(DISTRIBUTIONS))
def test_every_top_level_import_is_a_declared_distribution(source: str) -> None:
    name, packages = DISTRIBUTIONS[source].name, DISTRIBUTIONS[source].packages
    declared = _declared(source) | {_normal(name), "vllm-port"} | {_normal(h) for h in HOSTS.get(source, "").split()}
    providers = importlib.metadata.packages_distributions()  # import name -> the distributions shipping it
    undeclared = {}
    for path in sorted((REPO / source / "src").rglob("*.py")):
        for module in _top_level_imports(path) - set(sys.stdlib_module_names) - set(packages) - {"vllm_port"}:
            shipped_by = {_normal(d) for d in providers.get(module, [module])}
            if not shipped_by & declared:
                undeclared.setdefault(module, []).append(str(path.relative_to(REPO)))
    assert not undeclared, f"{source} imports, undeclared in its pyproject.toml: {undeclared}"


# --- installed, one venv per distribution --------------------------------------------------------


def _clean_env(tmp: Path) -> dict[str, str]:
    """This environment less what would let a venv see the checkout or change its choices.

    ``TRITON_INTERPRET`` goes too: the test session sets it (conftest.py), and Triton's interpreter
    imports numpy, which nothing here declares.
    """
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("VLLM_PORT_")}
    env["VLLM_PORT_CACHE_DIR"] = str(tmp / "cache")  # the CPU plugin's native kernels, off anyway below
    env["VLLM_PORT_CPU_NATIVE"] = "0"  # no C build: it says nothing about dependencies
    return env


def _run(argv: list[str], tmp: Path, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=tmp, env=_clean_env(tmp), capture_output=True, text=True, timeout=400)
    assert done.returncode in ok, (
        f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


def _pip_install(python: Path, *requirements: str) -> None:
    """Install with this interpreter's pip into ``python``'s venv, dependencies resolved by pip.

    ``--no-compile``: Python compiles what it imports; what is installed is the same.
    """
    argv = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile", *requirements]
    _run(argv, python.parents[2])


@pytest.fixture(scope="module")
def base(
    distribution_wheels: dict[str, Path], torch_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Every distribution's wheel, the torch venv, and the base venv above it: core with the dependencies core declares."""
    work = tmp_path_factory.mktemp("declared")
    python = make_venv(work / "base", _clean_env(work), below=[torch_venv])
    _pip_install(python, torch_pin(), str(distribution_wheels["core"]))  # torch: found installed below
    return {"work": work, "base": work / "base", "torch": torch_venv, **distribution_wheels}


def _in_repo_dependencies(source: str, wheels: dict[str, Path]) -> list[Path]:
    """The wheels of the other distributions of this repository that ``source`` declares (core is in the base venv):
    pip finds them nowhere else, as a user's pip finds them on the index."""
    names = {_normal(d.name): folder for folder, d in DISTRIBUTIONS.items() if folder not in ("core", source)}
    return [wheels[names[name]] for name in sorted(_declared(source) & set(names))]


def _needing_the_host(source: str) -> list[str]:
    """The modules of ``source`` that import its host engine (:data:`HOSTS`) when they are imported."""
    if source not in HOSTS:
        return []
    (package,) = DISTRIBUTIONS[source].packages
    root = REPO / source / "src" / package
    return [
        ".".join((package, *path.relative_to(root).with_suffix("").parts))
        for path in sorted(root.rglob("*.py"))
        if HOSTS[source] in _top_level_imports(path)
    ]


def _imports_every_module(python: Path, packages: list[str], tmp: Path, skip: list[str]) -> None:
    done = _run([str(python), "-W", "ignore", "-c", IMPORT_EVERY_MODULE, ",".join(packages), *skip], tmp)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] > 0 and not result["failed"], f"modules that do not import: {result['failed']}"


def _doctor(python: Path, tmp: Path) -> dict:
    done = _run([str(python), "-W", "ignore", "-m", "vllm_port.cli", "doctor", "--json"], tmp, ok=(0, 1, 2))
    return json.loads(done.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("source", list(DISTRIBUTIONS))
def test_a_venv_of_its_declared_dependencies_loads_it(source: str, base: dict[str, Path], tmp_path: Path) -> None:
    packages = list(DISTRIBUTIONS[source].packages)
    if source == "core":
        python = base["base"] / "bin" / "python"
    else:
        python = make_venv(tmp_path / "venv", _clean_env(tmp_path), below=[base["base"], base["torch"]])
        _pip_install(python, str(base[source]), *map(str, _in_repo_dependencies(source, base)))
    # core's own Triton kernels need its `triton` extra, which the CUDA plugin brings as a dependency
    skip = [m for m, extra in NEEDS_EXTRA.items() if not (extra == "triton" and source == "plugins/vllm-port-cuda")]
    skip += _needing_the_host(source)  # the bridge's modules that import vLLM: they load inside vLLM only
    extra = ["vllm_port.kernels.triton"] if "vllm_port.kernels.triton" not in skip else []
    _imports_every_module(python, packages + extra, tmp_path, skip)

    report = _doctor(python, tmp_path)
    plugins = {p["name"]: p for p in report["plugins"]}
    for plugin in plugins.values():
        assert plugin["error"] is None, f"{plugin['name']}: {plugin['error']}"
        assert not plugin["rejected_providers"], plugin["rejected_providers"]
    if source == "plugins/vllm-port-cpu":
        assert report["selected"] == "cpu" and report["ok"], report["error"]
    elif source in GPU_PLUGINS:
        assert list(plugins) == [GPU_PLUGINS[source]]
        # the suite only now: its dependencies (pytest, hypothesis) must not be what let the plugin load
        _pip_install(python, str(base["conformance"]))
        certify = [str(python), "-W", "ignore", "-m", "vllm_port.cli", "certify", GPU_PLUGINS[source]]
        done = _run([*certify, "--report", str(tmp_path / "report")], tmp_path, ok=(0, 1, 2))
        assert done.returncode == 2 and "device absent" in done.stdout + done.stderr, done.stdout[-2000:]
    else:
        assert plugins == {}  # core alone, the suite or the bridge: no platform plugin
    if source in HOSTS:  # without its host the bridge says what is missing, not an ImportError from deep inside
        done = _run([str(python), "-W", "ignore", "-m", "vllm_port_vllm.compat"], tmp_path, ok=(1,))
        said = done.stdout + done.stderr
        assert "Traceback" not in said, said
        assert f"vLLM is not installed here (No module named {HOSTS[source]!r})" in said, said
