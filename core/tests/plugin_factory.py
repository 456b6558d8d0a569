"""Real test plugins: a module and a dist-info folder on sys.path, found by ``importlib.metadata``
exactly as pip-installed packages are, so discovery runs its real path (entry points, import,
pluggy registration, hooks). Fixtures using these live in conftest.py.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

_counter = itertools.count()

#: The hooks of a minimal healthy platform plugin; tests replace the ones they break.
HEALTHY = """
from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl

@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"

@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name=PLATFORM, device_type="cpu", priority=PRIORITY, dist_backend="gloo")

@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))
"""


def write_plugin(site: Path, name: str, source: str, version: str = "0.0.1") -> str:
    """Write plugin ``name`` (module from ``source``) with its dist-info into ``site``; return the module name."""
    module = f"vllm_port_test_{name.replace('-', '_')}_{next(_counter)}"
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = site / f"vllm_port_test_{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-port-test-{name}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm_port]\n{name} = {module}\n")
    return module


def healthy(platform: str = "fake", priority: int = 5, extra: str = "") -> str:
    """Source of a healthy platform plugin, with ``extra`` source appended (more hooks, overrides)."""
    return f"PLATFORM = {platform!r}\nPRIORITY = {priority}\n" + HEALTHY + textwrap.dedent(extra)
