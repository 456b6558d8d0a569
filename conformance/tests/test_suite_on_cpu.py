"""The suite run on the CPU plugin, as a vendor runs it: pytest in a subprocess, from a folder of its own.

Not the certification's run (``cpu_certified``): this one runs without the recorder (no fixed seeds,
hypothesis not derandomized), as ``pytest --pyargs vllm_port_conformance.checks`` does for a vendor.
It runs outside this repository, as a vendor's does: this repository's pytest configuration (its
conftest.py, and pytest-xdist's workers from pyproject.toml's addopts) is not the suite's.
"""

import subprocess
import sys

import pytest


def run_suite(folder, *args):
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--pyargs",
        "vllm_port_conformance.checks",
        *args,
    ]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True)


@pytest.mark.slow
def test_cpu_plugin_passes_the_suite(tmp_path):
    proc = run_suite(tmp_path, "--vllm-port-plugin", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


@pytest.mark.slow
def test_suite_without_a_plugin_name_is_a_usage_error(tmp_path):
    proc = run_suite(tmp_path)
    assert proc.returncode != 0
    assert "--vllm-port-plugin NAME" in proc.stdout + proc.stderr
