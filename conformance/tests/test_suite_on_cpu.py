"""The suite run on the CPU plugin, as a vendor runs it: pytest in a subprocess."""

import subprocess
import sys


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


def test_cpu_plugin_passes_the_suite():
    proc = run_suite("--vllm-port-plugin", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_suite_without_a_plugin_name_is_a_usage_error():
    proc = run_suite()
    assert proc.returncode != 0
    assert "--vllm-port-plugin NAME" in proc.stdout + proc.stderr
