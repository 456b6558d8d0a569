"""The suite run on the CPU plugin, as a vendor runs it: pytest in a subprocess.

Not the certification's run (``cpu_certified``): this one runs without the recorder (no fixed seeds,
hypothesis not derandomized), as ``pytest --pyargs vllm_port_conformance.checks`` does for a vendor.
"""

import subprocess
import sys

import pytest


def run_suite(*args):
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
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.mark.slow
def test_cpu_plugin_passes_the_suite():
    proc = run_suite("--vllm-port-plugin", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_suite_without_a_plugin_name_is_a_usage_error():
    proc = run_suite()
    assert proc.returncode != 0
    assert "--vllm-port-plugin NAME" in proc.stdout + proc.stderr
