"""``vllm-port new-plugin``: the generated vendor package is complete, installs from outside the
repository, is discovered by ``doctor``, and certifies on CPU, by hand and through ``tox -e conformance``."""

from __future__ import annotations

import configparser
import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vllm_port import API_VERSION, PlatformDescription, cli
from vllm_port.memory import HostMemoryAllocator, default_allocator
from vllm_port.ops import ALL_OPS, OpRegistry
from vllm_port.platform import validate_description, validate_probe
from vllm_port.plugin_kit import DeviceAllocator, StreamGraphCapture, device_context_created
from vllm_port.scaffold import GENERATED_PRIORITY, ScaffoldError, new_plugin

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[3]
NAME = "scaffoldchip"
SOURCES = ("__init__", "plugin", "platform", "ops", "memory", "comm")


def _env(**extra: str) -> dict[str, str]:
    """This environment without vllm-port's selection variables or a PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_PORT_") and k != "PYTHONPATH"}
    return {**env, **extra}


def _run(*args: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: int = 600):
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A plugin generated once for this module (nothing installs it into this interpreter)."""
    return new_plugin(NAME, tmp_path_factory.mktemp("vendor") / f"vllm-port-{NAME}").root


@pytest.fixture
def imported(package: Path) -> Iterator[object]:
    """The generated package imported from its source folder; removed from the interpreter afterwards."""
    sys.path.insert(0, str(package / "src"))
    try:
        yield importlib.import_module(f"vllm_port_{NAME}.plugin")
    finally:
        sys.path.remove(str(package / "src"))
        for module in [m for m in sys.modules if m.startswith(f"vllm_port_{NAME}")]:
            del sys.modules[module]


def test_the_package_has_the_anatomy_of_the_in_tree_plugins(package: Path) -> None:
    src = package / "src" / f"vllm_port_{NAME}"
    assert sorted(p.stem for p in src.glob("*.py")) == sorted(SOURCES)
    assert (src / "py.typed").is_file() and (package / "tests" / "test_conformance.py").is_file()
    assert all(len((src / f"{s}.py").read_text().splitlines()) <= 80 for s in SOURCES)  # one short file each
    meta = tomllib.loads((package / "pyproject.toml").read_text())
    assert meta["build-system"]["requires"] == ["setuptools>=77"]
    assert meta["project"]["name"] == f"vllm-port-{NAME}"
    assert meta["project"]["entry-points"]["vllm_port"] == {NAME: f"vllm_port_{NAME}.plugin"}
    assert any(d.startswith("vllm-port>=0.") for d in meta["project"]["dependencies"])
    assert {"pytest>=8", "tox>=4"} <= set(meta["project"]["optional-dependencies"]["test"])
    tox = configparser.ConfigParser(interpolation=None)
    tox.read_string((package / "tox.ini").read_text())
    assert {"testenv:conformance", "testenv:lint", "testenv:build", "testenv:tests"} <= set(tox.sections())
    assert f"vllm-port certify {NAME} --report reports/{NAME}" in tox["testenv:conformance"]["commands"]
    assert "{env:VLLM_PORT_CORE:" in tox["testenv"]["deps"] and "{env:VLLM_PORT_TORCH:torch==" in tox["testenv"]["deps"]


@pytest.mark.parametrize(
    ("name", "device_type"), [(NAME, "cpu"), ("x" * 32, "cuda"), ("x" * 32, "xpu"), ("x" * 32, "mps")]
)
def test_the_generated_code_is_clean_under_ruff(name: str, device_type: str, package: Path, tmp_path: Path) -> None:
    """Every variant of the files, with names up to the longest allowed (32 characters)."""
    root = package if name == NAME else new_plugin(name, tmp_path / "p", device_type=device_type).root
    ruff = Path(sys.executable).parent / "ruff"
    for args in (["check"], ["format", "--check"]):
        done = _run(ruff, *args, "src", "tests", cwd=root)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_plugin_answers_every_hook_and_a_provider_for_every_op(imported) -> None:
    plugin = imported
    assert plugin.vllm_port_api_range() == f">={API_VERSION},<2"
    desc = validate_description(plugin.vllm_port_platform_describe())
    assert (desc.name, desc.device_type, desc.dist_backend) == (NAME, "cpu", "gloo")
    probe = validate_probe(plugin.vllm_port_platform_probe())
    assert probe.available and probe.devices[0].total_memory > 0
    registry = OpRegistry(ALL_OPS)
    providers = plugin.vllm_port_providers()
    for p in providers:
        registry.register(p, plugin=NAME, platform=NAME)  # refuses a provider that breaks its op's contract
    assert sorted(p.op for p in providers) == sorted(op.name for op in ALL_OPS)
    assert plugin.vllm_port_collectives(desc) is not None and plugin.vllm_port_point_to_point(desc) is not None
    assert plugin.vllm_port_allocator(desc) is not None
    other = PlatformDescription("cpu", "cpu", 0, "gloo")  # another plugin's platform: not this plugin's to serve
    assert plugin.vllm_port_allocator(other) is None and plugin.vllm_port_collectives(other) is None


def test_every_hook_is_a_function_written_in_plugin_py(package: Path, imported) -> None:
    """plugin.py defines each hook it answers, as the in-tree plugins do: a reader (and grep) finds every one there."""
    source = (package / "src" / f"vllm_port_{NAME}" / "plugin.py").read_text()
    hooks = sorted(attr for attr in dir(imported) if attr.startswith("vllm_port_"))
    assert "globals()" not in source and source.count("@hookimpl\ndef ") == len(hooks) == 7
    assert all(f"@hookimpl\ndef {hook}(" in source for hook in hooks)
    assert {getattr(imported, hook).__module__ for hook in hooks} == {f"vllm_port_{NAME}.plugin"}
    assert not hasattr(imported, "vllm_port_platform_context_created")  # a CPU makes no device context
    assert not hasattr(imported, "vllm_port_graph_capture")
    allocator = imported.vllm_port_allocator(imported.vllm_port_platform_describe())
    assert isinstance(allocator, HostMemoryAllocator) and not allocator.pinned  # core's host allocator
    assert allocator.name == f"{NAME} host allocator"


@contextmanager
def _generated(tmp_path: Path, name: str, device_type: str) -> Iterator[ModuleType]:
    """A plugin generated for ``device_type``, its ``plugin`` module imported; removed from the interpreter afterwards."""
    made = new_plugin(name, tmp_path / name, device_type=device_type)
    sys.path.insert(0, str(made.root / "src"))
    try:
        yield importlib.import_module(f"vllm_port_{name}.plugin")
    finally:
        sys.path.remove(str(made.root / "src"))
        for module in [m for m in sys.modules if m.startswith(f"vllm_port_{name}")]:
            del sys.modules[module]


def test_a_gpu_device_type_generates_a_probe_that_says_why_it_is_absent(tmp_path: Path) -> None:
    with _generated(tmp_path, "scaffoldgpu", "cuda") as plugin:
        desc = validate_description(plugin.vllm_port_platform_describe())
        assert (desc.device_type, desc.dist_backend, desc.memory_tiers) == ("cuda", "nccl", ("device", "pinned_host"))
        probe = validate_probe(plugin.vllm_port_platform_probe())
        assert probe.available == torch.cuda.is_available()
        assert probe.available or "sees no cuda device" in probe.reason
        assert plugin.vllm_port_platform_context_created() is torch.cuda.is_initialized()


@pytest.mark.parametrize("device_type", ["cuda", "xpu"])
def test_a_gpu_plugin_takes_the_device_allocator_and_context_check_of_the_kit(device_type: str, tmp_path: Path) -> None:
    with _generated(tmp_path, f"scaffold{device_type}", device_type) as plugin:
        desc = plugin.vllm_port_platform_describe()
        allocator = plugin.vllm_port_allocator(desc)  # made without touching the device
        assert type(allocator) is DeviceAllocator and allocator.torch_device == device_type
        assert allocator.device == torch.device(device_type) and allocator.name == f"scaffold{device_type} allocator"
        module = getattr(torch, device_type)
        assert plugin.vllm_port_platform_context_created() is module.is_initialized()
        assert plugin.device_context_created is device_context_created  # the kit's check, called by its own hook
        assert plugin.vllm_port_platform_context_created.__module__ == f"vllm_port_scaffold{device_type}.plugin"


def test_cuda_graphs_come_wired_to_the_kit_and_off_until_the_vendor_turns_them_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference ops read device values on the host, which a capture refuses: a generated plugin starts eager."""
    with _generated(tmp_path, "scaffoldgraphs", "cuda") as plugin:
        desc = plugin.vllm_port_platform_describe()
        assert desc.graph_capture is False and sys.modules["vllm_port_scaffoldgraphs.platform"].GRAPH_CAPTURE is False
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")  # so it builds on a machine without CUDA
        capture = plugin.vllm_port_graph_capture(desc)
        assert type(capture) is StreamGraphCapture and capture.name == "scaffoldgraphs graphs"
        assert (capture.torch_device, capture.graph_type, capture.pool) == ("cuda", "CUDAGraph", "pool")
        assert plugin.vllm_port_graph_capture(PlatformDescription("cpu", "cpu", 0, "gloo")) is None
    with _generated(tmp_path, "scaffoldxpu", "xpu") as plugin:
        assert not hasattr(plugin, "vllm_port_graph_capture")  # no in-tree plugin captures XPU graphs yet


def test_a_device_type_without_torchs_memory_queries_keeps_cores_default_allocator(tmp_path: Path) -> None:
    """``torch.mps`` has no ``mem_get_info`` or ``is_initialized``: core's default allocator, no context check."""
    with _generated(tmp_path, "scaffoldmps", "mps") as plugin:
        memory = sys.modules["vllm_port_scaffoldmps.memory"]
        assert "return default_allocator(DEVICE_TYPE)" in Path(memory.__file__).read_text()
        assert memory.allocator() is default_allocator("mps") is None  # torch's accelerator here is not mps
        assert not hasattr(plugin, "vllm_port_platform_context_created")


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("MyChip", "lowercase letters and digits"),
        ("my-chip", "words joined by single underscores"),
        ("2chip", "starting with a letter"),
        ("a" * 33, "at most 32 characters"),
        ("cpu", "taken: an installed plugin already declares it (vllm_port_cpu.plugin)"),
    ],
)
def test_a_bad_name_is_refused_saying_the_rule(name: str, said: str, tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match=r"plugin name") as caught:
        new_plugin(name, tmp_path / "p")
    assert said in str(caught.value) and repr(name) in str(caught.value)
    assert not (tmp_path / "p").exists()


def test_a_device_type_torch_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match=r"device type 'warp9' is not one torch knows"):
        new_plugin("chip", tmp_path / "p", device_type="warp9")


def test_a_folder_with_files_is_never_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    assert cli.main(["new-plugin", "chip", "--path", str(tmp_path / "full")]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert cli.main(["new-plugin", "chip", "--path", str(tmp_path / "empty")]) == 0
    out = capsys.readouterr().out
    assert "created vllm-port-chip" in out and "vllm-port certify chip --report reports/chip" in out
    assert f"VLLM_PORT_CORE={REPO / 'core'}" in out  # run from this checkout: tox is told where core is


def _install_outside(package: Path, site: Path) -> None:
    """pip-install the package (built as a wheel, not editable) into ``site``, outside this venv."""
    done = _run(
        sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, package
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _doctor(env: dict[str, str], *args: str) -> dict:
    doctor = _run(sys.executable, "-m", "vllm_port.cli", "doctor", "--json", *args, env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    return json.loads(doctor.stdout)


@pytest.mark.slow
def test_installed_from_outside_it_is_discovered_displaces_no_platform_and_runs_when_named(
    package: Path, tmp_path: Path
) -> None:
    """Installed as a wheel outside this venv; that it certifies is the tox test below (one certification in CI)."""
    site = tmp_path / "site"
    _install_outside(package, site)
    assert (site / f"vllm_port_{NAME}" / "plugin.py").is_file()
    env = _env(PYTHONPATH=str(site))
    report = _doctor(env)
    mine = next(p for p in report["plugins"] if p["name"] == NAME)
    assert mine["available"] and mine["distribution"] == f"vllm-port-{NAME}" and mine["error"] is None
    in_tree = {p["name"]: p["priority"] for p in report["plugins"] if p["name"] in ("cpu", "cuda", "rocm", "xpu")}
    assert len(in_tree) == 4 and mine["priority"] == GENERATED_PRIORITY < min(in_tree.values())
    assert report["selected"] == "cpu"  # its reference ops never displace the cpu plugin's
    named = _doctor(env, "--device", NAME)
    assert named["selected"] == NAME
    assert {op["provider"] for op in named["ops"].values()} == {f"{NAME}_reference_{op.name}" for op in ALL_OPS}


def test_the_generated_priority_is_below_every_in_tree_plugin_and_says_how_to_raise_it(package: Path) -> None:
    in_tree = {}
    for name in ("cpu", "cuda", "rocm", "xpu"):
        platform = importlib.import_module(f"vllm_port_{name}.platform")
        in_tree[name] = platform.describe().priority
    assert GENERATED_PRIORITY < min(in_tree.values())
    source = (package / "src" / f"vllm_port_{NAME}" / "platform.py").read_text()
    assert f"\nPRIORITY = {GENERATED_PRIORITY}\n" in source
    said = " ".join(line.removeprefix("#:").strip() for line in source.splitlines() if line.startswith("#:"))
    assert in_tree["cuda"] == in_tree["rocm"]
    assert f"(cpu {in_tree['cpu']}, xpu {in_tree['xpu']}, cuda and rocm {in_tree['cuda']})" in said  # as they stand
    assert "raise it above the plugin it should win over (PRIORITY = 1 is above cpu)" in said


@pytest.mark.slow
def test_tox_conformance_certifies_the_package_in_a_fresh_venv(package: Path, tmp_path: Path) -> None:
    """The issue's CI requirement: ``tox -e conformance`` from the generated folder, core from this checkout."""
    vendor = tmp_path / "vendor"
    shutil.copytree(package, vendor)
    git = ["git", "-c", "user.email=vendor@example.com", "-c", "user.name=vendor", "-C", str(vendor)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "generated by vllm-port new-plugin"]):
        assert _run(*git, *args).returncode == 0
    commit = _run(*git, "rev-parse", "HEAD").stdout.strip()
    env = _env(VLLM_PORT_CORE=f"-e {REPO / 'core'}", VLLM_PORT_CONFORMANCE=f"-e {REPO / 'conformance'}")
    # tox hands its commands only the variables it is told to: the run's one torch thread (conftest.py), and pip
    # installing torch without compiling its 2,000 modules (Python compiles and caches those it imports)
    env["PIP_NO_COMPILE"] = "1"
    passed = [arg for name in ("OMP_NUM_THREADS", "PIP_NO_COMPILE") for arg in ("-x", f"testenv.pass_env+={name}")]
    done = _run(sys.executable, "-m", "tox", *passed, "-e", "conformance", cwd=vendor, env=env)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report = json.loads((vendor / "reports" / NAME / "report.json").read_text())
    assert report["verdict"] == "certified" and report["summary"]["passed"] == report["summary"]["total"] > 100
    assert report["plugin"]["distribution"] == f"vllm-port-{NAME}"
    assert report["plugin"]["git"] == {"commit": commit, "dirty": False, "from": report["plugin"]["git"]["from"]}
    assert str(vendor / "src") in report["plugin"]["git"]["from"]  # its own checkout, not this repository's
    assert "report verified" in done.stdout
