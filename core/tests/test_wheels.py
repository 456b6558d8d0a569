"""Built wheels, not only editable installs: core, the CPU plugin and the suite install into a clean venv and run.

The wheels are built with pip as a user would (``pip wheel --no-deps``, build isolation on, so the
declared build requirements are the ones used) from copies of the sources, so no ``build/`` left in
the tree can leak stale files in: once a session for this module and test_declared_dependencies.py
(``distribution_wheels``, see distributions.py). The venv is new and sees nothing of this checkout:
pip resolves the wheels' declared dependencies, and each command runs outside the repository. Torch
(the pin in dev/requirements.txt) it finds installed in the session's torch venv below it
(``torch_venv``), which test_declared_dependencies.py's venvs see too: installed once, not per venv.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from distributions import DISTRIBUTIONS, WHEELS_GROUP, make_venv, torch_pin

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
BUILT = ("core", "plugins/vllm-port-cpu", "conformance")
PROMPT = "It is a truth universally acknowledged"
pytestmark = pytest.mark.xdist_group(WHEELS_GROUP)  # one worker builds the wheels, for both modules


@pytest.mark.parametrize("source", sorted(DISTRIBUTIONS))
def test_every_distribution_declares_its_build_and_license(source: str) -> None:
    project = tomllib.loads((REPO / source / "pyproject.toml").read_text())
    # the SPDX `license` string and `license-files` need setuptools 77 (PEP 639); older ones reject them
    assert "setuptools>=77" in project["build-system"]["requires"], source
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    assert (REPO / source / "LICENSE").read_bytes() == (REPO / "LICENSE").read_bytes(), f"{source}/LICENSE differs"


@pytest.fixture(scope="module")
def wheels(distribution_wheels: dict[str, Path]) -> dict[str, Path]:
    """The wheels of :data:`BUILT` (import package -> wheel), from the session's build of every distribution."""
    return {DISTRIBUTIONS[source].packages[0]: distribution_wheels[source] for source in BUILT}


@pytest.mark.slow
def test_each_wheel_carries_its_license_and_package_data(wheels: dict[str, Path]) -> None:
    license_text = (REPO / "LICENSE").read_bytes()
    for name, whl in wheels.items():
        with zipfile.ZipFile(whl) as archive:
            files = set(archive.namelist())
            license_file = f"{name}-0.1.0.dist-info/licenses/LICENSE"
            assert license_file in files, f"{whl.name} lacks its LICENSE"
            assert archive.read(license_file) == license_text
            assert "License-Expression: Apache-2.0" in archive.read(f"{name}-0.1.0.dist-info/METADATA").decode()
            assert f"{name}/py.typed" in files
    with zipfile.ZipFile(wheels["vllm_port"]) as archive:
        model = {f for f in archive.namelist() if f.startswith("vllm_port/data/bundled-model/")}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {Path(f).name for f in model}
    with zipfile.ZipFile(wheels["vllm_port_conformance"]) as archive:
        assert "vllm_port_conformance/waivers.toml" in archive.namelist()
        requires = archive.read("vllm_port_conformance-0.1.0.dist-info/METADATA").decode()
        assert 'Requires-Dist: tomli>=1.1; python_version < "3.11"' in requires


@pytest.mark.slow
def test_wheels_install_into_a_clean_venv_and_run(wheels: dict[str, Path], torch_venv: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    python = make_venv(venv, _clean_env(), below=[torch_venv])  # this pip installs into it; torch is below
    cli = str(venv / "bin" / "vllm-port")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile"]
    _run([*install, torch_pin(), *map(str, wheels.values())], tmp_path)

    where = _run(
        [str(python), "-c", "import vllm_port, vllm_port_cpu; print(vllm_port.__file__, vllm_port_cpu.__file__)"],
        tmp_path,
    )
    assert all(path.startswith(str(venv)) for path in where.split()), f"imported from outside the venv: {where}"
    version = _run([cli, "--version"], tmp_path)
    assert "vllm-port 0.1.0" in version and "plugin cpu          vllm-port-cpu 0.1.0" in version
    assert "cuda" not in version  # only what was installed
    doctor = _run([cli, "doctor"], tmp_path)
    assert "Selected platform: cpu" in doctor and doctor.rstrip().endswith("OK")
    generated = _run([cli, "generate", "--max-tokens", "8", PROMPT], tmp_path)
    assert generated.startswith(PROMPT) and len(generated) > len(PROMPT)
    waivers = _run(
        [
            str(python),
            "-c",
            "from vllm_port_conformance import certify as c; print(c.DEFAULT_WAIVERS.is_file(), c.DEFAULT_WAIVERS)",
        ],
        tmp_path,
    )
    assert waivers.startswith(f"True {venv}")
    # matplotlib is the `plot` extra, not a dependency: --plot says so before timing anything
    plot = subprocess.run(
        [cli, "bench", "ops", "--plot", "x.png"],
        cwd=tmp_path,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plot.returncode == 2 and "pip install 'vllm-port[plot]'" in plot.stderr


def _clean_env() -> dict[str, str]:
    """This process's environment less what would let the venv see the checkout or change its choices."""
    return {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("VLLM_PORT_")
    }


def _run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (
        f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout
