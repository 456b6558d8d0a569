"""``vllm-port doctor`` end to end, as a user runs it: a subprocess over the installed plugins."""

import json
import subprocess
import sys

import pytest
from plugin_factory import healthy


def doctor(*args, env=None):
    import os

    proc = subprocess.run(
        [sys.executable, "-m", "vllm_port.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_json_selects_cpu_lists_every_plugin_and_smoke_passes():
    code, out, err = doctor("--json")
    report = json.loads(out)
    assert code == 0, err
    assert report["selected"] == "cpu" and report["api_version"] == "1.1"
    assert report["platform"] == {
        "graph_capture": False,
        "compile_backend": "inductor",
        "memory_tiers": ["device"],
        "kv_block_size": 16,
        "dist_backend": "gloo",
    }
    for plugin in report["plugins"]:
        assert {"name", "version", "available", "reason", "device_type", "device_count", "priority", "error"} <= set(
            plugin
        )
        assert plugin["reason"]
    for name in ("rms_norm", "silu_and_mul"):
        assert report["ops"][name]["provider"] == f"cpu_{name}"
        assert {"provider": f"cpu_{name}", "plugin": "cpu", "platform": "cpu", "priority": 10} in report["ops"][name][
            "candidates"
        ]
        assert report["smoke"][name] == "PASS"


@pytest.mark.slow
def test_a_broken_plugin_is_reported_and_doctor_still_passes(install_plugin):
    install_plugin("zbroken", "raise ImportError('missing libzbroken.so')")
    code, out, _ = doctor("--json")
    report = json.loads(out)
    assert code == 0 and report["selected"] == "cpu"
    broken = next(p for p in report["plugins"] if p["name"] == "zbroken")
    assert broken["available"] is False and "missing libzbroken.so" in broken["error"]


@pytest.mark.slow
def test_a_wrong_kernel_fails_the_smoke_test(install_plugin):
    install_plugin(
        "wrong",
        healthy(
            "wrong",
            priority=99,
            extra="from vllm_port.ops import provider\n"
            "@provider('rms_norm', priority=5)\ndef no_weight(x, weight, epsilon):\n    return x\n"
            "@hookimpl\ndef vllm_port_providers():\n    return [no_weight]\n",
        ),
    )
    code, out, _ = doctor()
    assert code == 1
    assert "FAIL: no_weight (wrong) torch.float32" in out and "NOT OK" in out


@pytest.mark.slow
def test_unknown_device_exits_2_with_the_fix(monkeypatch):
    code, out, _ = doctor(env={"VLLM_PORT_DEVICE": "tpu"})
    assert code == 2 and "VLLM_PORT_DEVICE='tpu' names no installed platform" in out
    code, out, _ = doctor("--plugins", "cpu,nonesuch")
    assert code == 2 and "names 'nonesuch', but no installed plugin is called that" in out
