"""Helpers for the certification tests: install real test plugins (a module and a dist-info folder) and run ``vllm-port certify``.

As in core's tests: ``importlib.metadata`` finds a dist-info folder on ``PYTHONPATH`` exactly as it
finds pip-installed packages, so discovery, the suite and certify run their real paths.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_counter = itertools.count()


def write_plugin(site: Path, name: str, source: str, version: str = "0.0.1") -> str:
    """Write plugin ``name`` (module from ``source``) with its dist-info into ``site``; return the module name."""
    module = f"vllm_port_test_{name.replace('-', '_')}_{next(_counter)}"
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    dist_info = site / f"vllm_port_test_{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-port-test-{name}\nVersion: {version}\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm_port]\n{name} = {module}\n")
    return module


@dataclass
class Certified:
    """One ``vllm-port certify`` run: exit status, output, and the report it wrote (if any)."""

    returncode: int
    stdout: str
    stderr: str
    report_dir: Path | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def report(self) -> dict[str, Any]:
        assert self.report_dir is not None
        return json.loads((self.report_dir / "report.json").read_text())


def run_certify(*args: str, site: Path | None = None, report_dir: Path | None = None) -> Certified:
    """Run ``vllm-port certify ARGS`` in a subprocess (with ``site`` on ``PYTHONPATH``)."""
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    extra = ["--report", str(report_dir)] if report_dir is not None else []
    cmd = [sys.executable, "-m", "vllm_port.cli", "certify", *args, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return Certified(proc.returncode, proc.stdout, proc.stderr, report_dir)
