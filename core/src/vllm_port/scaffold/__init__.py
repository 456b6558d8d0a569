"""``vllm-port new-plugin``: generate an out-of-tree vendor package that certifies from its first minute.

The package (``vllm-port-NAME``, import name ``vllm_port_NAME``) has the anatomy of the in-tree
plugins, one short file each: ``platform`` (describe and probe), ``ops`` (a provider per contract op,
delegating to the references), ``memory`` (core's host allocator on ``cpu``; on a GPU,
:class:`~vllm_port.plugin_kit.DeviceAllocator`), ``comm`` (torch.distributed on the platform's
backend), ``graph`` on a device type with graphs (:class:`~vllm_port.plugin_kit.StreamGraphCapture`,
off until the vendor's decode kernels capture), and ``plugin``: every hook it answers, one
``@hookimpl`` function each, calling those files (and :func:`~vllm_port.plugin_kit.device_context_created`
on a device with contexts). So each file holds only what is the vendor's, as in the in-tree plugins.
A README, ``tests/`` that run the conformance suite, and a ``tox.ini`` with ``conformance``,
``tests``, ``lint`` and ``build`` environments. On a device torch already knows (the host CPU by
default) it installs, is discovered by ``vllm-port doctor`` and certifies before the vendor writes a
line. Its platform's priority (:data:`GENERATED_PRIORITY`) is below every in-tree plugin's, so
installing it changes no selection: it runs where named (``--device NAME``) until the vendor raises
it in ``platform.py``.
"""

from __future__ import annotations

import keyword
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ..api import API_VERSION
from ..errors import VllmPortError
from . import _templates as t

__all__ = [
    "DIST_BACKENDS",
    "GENERATED_PRIORITY",
    "GRAPH_TYPES",
    "Scaffold",
    "ScaffoldError",
    "check_device_type",
    "check_name",
    "main",
    "new_plugin",
]

#: The torch.distributed backend of each device type torch knows; others start on gloo until the
#: vendor names its own (comm.py says how).
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "hpu": "hccl", "mps": "gloo"}
#: The graph class in torch's device module of each device type whose graphs the in-tree plugins
#: capture (CUDA, and HIP through the ``torch.cuda`` of ROCm builds); a plugin on another starts without.
GRAPH_TYPES = {"cuda": "CUDAGraph"}
#: The platform priority a generated package starts with: below every in-tree plugin's (cpu 0, xpu 90,
#: cuda and rocm 100), so that installing a package whose ops are still the references displaces no
#: platform. Selection takes the available platform of highest priority (:func:`vllm_port.runtime.select`).
GENERATED_PRIORITY = -1
#: What :class:`vllm_port.plugin_kit.DeviceAllocator` calls on a torch device module.
_CACHING_ALLOCATOR = ("mem_get_info", "memory_reserved", "memory_allocated", "empty_cache")
_NAME = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
_MAX_NAME = 32


class ScaffoldError(VllmPortError):
    """The plugin cannot be generated as asked (a bad name, a device type torch lacks, a used folder)."""


@dataclass(frozen=True)
class Scaffold:
    """What :func:`new_plugin` made: the package's folder, its names and the files, relative to ``root``."""

    root: Path
    name: str
    distribution: str
    module: str
    files: tuple[str, ...]


def check_name(name: str) -> str:
    """Return ``name`` if it can name a plugin (entry point, platform, ``vllm_port_NAME``), else raise.

    :raises ScaffoldError: naming the value and the rule: lowercase letters and digits, words
        joined by single underscores, starting with a letter, at most 32 characters, and not the
        name of an installed plugin (discovery would refuse both).
    """
    if not _NAME.fullmatch(name) or len(name) > _MAX_NAME or keyword.iskeyword(name):
        raise ScaffoldError(
            f"plugin name {name!r} is not usable: use lowercase letters and digits, words joined by single "
            f"underscores, starting with a letter, at most {_MAX_NAME} characters (e.g. 'mychip', 'acme_npu')"
        )
    taken = {ep.name: ep.value for ep in metadata.entry_points(group="vllm_port")}
    if name in taken:
        raise ScaffoldError(
            f"plugin name {name!r} is taken: an installed plugin already declares it ({taken[name]}); "
            "two plugins of one name are both refused by discovery, so pick another name"
        )
    return name


def check_device_type(device_type: str) -> str:
    """Return ``device_type`` if torch knows it as a device type (``torch.device(device_type)``), else raise."""
    try:
        torch.device(device_type)
    except (RuntimeError, ValueError) as exc:
        known = ", ".join(sorted(DIST_BACKENDS))
        raise ScaffoldError(
            f"device type {device_type!r} is not one torch knows ({exc}); generate for a device torch "
            f"can already drive (e.g. {known}) and move to yours once its torch backend is registered"
        ) from None
    if device_type != "cpu" and not hasattr(torch, device_type):
        raise ScaffoldError(
            f"device type {device_type!r} has no torch.{device_type} module to probe devices with; "
            f"generate with --device-type cpu and write the probe for your driver in platform.py"
        )
    return device_type


def _core_range() -> str:
    """``>=X.Y,<X.(Y+1)``: the release series of the core generating the package (0.x series break)."""
    try:
        release = metadata.version("vllm-port").split("+")[0].split(".")
        major, minor = int(release[0]), int(release[1])
    except (metadata.PackageNotFoundError, ValueError, IndexError):
        return ""
    return f">={major}.{minor},<{major}.{minor + 1}" if major == 0 else f">={major}.{minor},<{major + 1}"


@dataclass(frozen=True)
class _DeviceParts:
    """Which of core's shared parts a device type's generated plugin uses (:mod:`vllm_port.plugin_kit`)."""

    memory: str  # the memory.py template
    context: bool  # torch.<device>.is_initialized() answers vllm_port_platform_context_created
    graph_type: str | None  # the graph class StreamGraphCapture captures into, or None: no graph.py


def _device_parts(device_type: str) -> _DeviceParts:
    if device_type == "cpu":
        return _DeviceParts(t.MEMORY_HOST, context=False, graph_type=None)
    module = getattr(torch, device_type)
    caching = all(hasattr(module, f) for f in _CACHING_ALLOCATOR)
    graph_type = GRAPH_TYPES.get(device_type)
    return _DeviceParts(
        t.MEMORY_DEVICE if caching else t.MEMORY_CORE_DEFAULT,
        context=hasattr(module, "is_initialized"),
        graph_type=graph_type if graph_type is not None and hasattr(module, graph_type) else None,
    )


def _values(name: str, device_type: str, parts: _DeviceParts) -> dict[str, str]:
    api_major = int(API_VERSION.split(".")[0])
    module = f"vllm_port_{name}"
    graphs = parts.graph_type is not None
    return {
        "name": name,
        "module": module,
        "dist": f"vllm-port-{name.replace('_', '-')}",
        "device_type": device_type,
        "dist_backend": DIST_BACKENDS.get(device_type, "gloo"),
        "priority": str(GENERATED_PRIORITY),
        "core_range": _core_range(),
        "api_range": f">={API_VERSION},<{api_major + 1}",  # the contract it is generated and certified with
        "torch": f"torch=={torch.__version__.split('+')[0]}",
        "modules": "comm, graph, memory, ops" if graphs else "comm, memory, ops",
        "platform_names": "DEVICE_TYPE, NAME, describe, probe" if parts.context else "NAME, describe, probe",
        "graph_part": ", ``graph`` (graph capture)" if graphs else "",
        "graph_import": "from vllm_port.graph_capture import GraphCapture\n" if graphs else "",
        "kit_import": "from vllm_port.plugin_kit import device_context_created\n" if parts.context else "",
        "context_hook": t.CONTEXT_HOOK if parts.context else "",
        "graph_hook": t.GRAPH_HOOK if graphs else "",
        "graph_flag": t.GRAPH_FLAG if graphs else "",
        "graph_capture": "GRAPH_CAPTURE" if graphs else "False",
        "graph_type": parts.graph_type or "",
        "graph_row": render(t.GRAPH_ROW, {"module": module}) if graphs else "",
    }


def render(template: str, values: dict[str, str]) -> str:
    """``template`` with every ``${key}`` replaced by ``values[key]``."""
    for key, value in values.items():
        template = template.replace("${" + key + "}", value)
    left = re.search(r"\$\{\w+\}", template)
    if left:
        raise AssertionError(f"scaffold template placeholder {left.group()} has no value")  # a bug in this module
    return template


def _files(values: dict[str, str], device_type: str, parts: _DeviceParts) -> dict[str, str]:
    src = f"src/{values['module']}"
    platform = t.PLATFORM_CPU if device_type == "cpu" else t.PLATFORM_ACCELERATOR
    graph = {f"{src}/graph.py": t.GRAPH} if parts.graph_type is not None else {}
    return {
        "pyproject.toml": t.PYPROJECT,
        "README.md": t.README,
        "tox.ini": t.TOX_INI,
        ".gitignore": t.GITIGNORE,
        f"{src}/__init__.py": t.INIT,
        f"{src}/plugin.py": t.PLUGIN,
        f"{src}/platform.py": platform,
        f"{src}/ops.py": t.OPS,
        f"{src}/memory.py": parts.memory,
        f"{src}/comm.py": t.COMM,
        **graph,
        f"{src}/py.typed": "",
        "tests/test_conformance.py": t.TEST_CONFORMANCE,
    }


def new_plugin(name: str, path: str | Path | None = None, device_type: str = "cpu") -> Scaffold:
    """Generate the vendor package ``vllm-port-NAME`` in ``path`` (default ``./vllm-port-NAME``).

    :param name: the plugin's name: its entry point, its platform's name, ``vllm_port_NAME``.
    :param path: the package's folder; it must not exist, or be empty.
    :param device_type: the torch device type the generated platform runs on until the vendor's own.
    :raises ScaffoldError: for a bad name or device type, or a folder that already holds files.
    """
    check_name(name)
    check_device_type(device_type)
    parts = _device_parts(device_type)
    values = _values(name, device_type, parts)
    root = Path(path) if path is not None else Path(values["dist"])
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ScaffoldError(
            f"{root} already exists and is not an empty folder; new-plugin never overwrites files: "
            "give another --path, or remove it"
        )
    files = _files(values, device_type, parts)
    for relative, template in files.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(render(template, values), encoding="utf-8")
    return Scaffold(root, name, values["dist"], values["module"], tuple(files))


def _checkout_of_core() -> Path | None:
    """The vllm-port repository this core runs from (an editable install), or ``None``."""
    repo = Path(__file__).resolve().parents[4]
    if (repo / "core" / "pyproject.toml").is_file() and (repo / "conformance" / "pyproject.toml").is_file():
        return repo
    return None


def main(name: str, path: str | None, device_type: str) -> int:
    """The ``vllm-port new-plugin`` command: generate, then print what was made and what to run next."""
    try:
        made = new_plugin(name, path, device_type)
    except ScaffoldError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created {made.distribution} in {made.root}/ ({len(made.files)} files):")
    for relative in made.files:
        print(f"  {relative}")
    repo = _checkout_of_core()
    sources = f"VLLM_PORT_CORE={repo / 'core'} VLLM_PORT_CONFORMANCE={repo / 'conformance'} " if repo else ""
    print(
        "\nnext:\n"
        f"  cd {made.root}\n"
        "  pip install -e .\n"
        f"  vllm-port doctor --device {made.name}   # named: its priority is below the in-tree plugins'\n"
        f"  vllm-port certify {made.name} --report reports/{made.name}\n"
        "or all of it in a fresh venv:\n"
        f"  {sources}tox -e conformance"
    )
    return 0
