"""``vllm-port doctor`` end to end, as a user runs it: a subprocess over the installed plugins."""

import json
import subprocess
import sys

import pytest
from cpu_providers import cpu_provider
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
    assert report["threads"]["torch_threads"] >= 1 and report["threads"]["cores"] >= 1  # the host's, checked
    assert report["threads"]["oversubscribed"] == (report["threads"]["advice"] is not None)
    assert report["platform"] == {
        "graph_capture": False,
        "compile_backend": "inductor",
        "memory_tiers": ["device"],
        "kv_block_size": 16,
        "kv_head_major": True,
        "dist_backend": "gloo",
    }
    for plugin in report["plugins"]:
        assert {"name", "version", "available", "reason", "device_type", "device_count", "priority", "error"} <= set(
            plugin
        )
        assert plugin["reason"]
    for name in ("rms_norm", "silu_and_mul"):
        assert report["ops"][name]["provider"] == cpu_provider(name)
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


# --- torch threads against the host's cores (issue 30) -------------------------------------------


def test_threads_that_fit_an_idle_host_get_no_advice():
    from vllm_port.host_threads import check_threads

    check = check_threads(cores=2, threads=2, load_average=1.1)  # this process alone
    assert not check.oversubscribed and check.advice is None and check.suggested_threads == 2


def test_two_threads_on_a_busy_two_core_host_are_told_to_use_one():
    from vllm_port.host_threads import check_threads

    check = check_threads(cores=2, threads=2, load_average=3.2)  # two other runnable tasks
    assert check.oversubscribed and check.suggested_threads == 1
    assert "OMP_NUM_THREADS=1" in check.advice and "load average 3.20" in check.advice


def test_more_threads_than_usable_cores_is_oversubscribed_whatever_the_load():
    from vllm_port.host_threads import check_threads

    check = check_threads(cores=4, threads=8, load_average=0.0)
    assert check.oversubscribed and "8 torch threads on 4 usable cores" in check.advice
    assert "OMP_NUM_THREADS=4" in check.advice
    assert not check_threads(cores=4, threads=1, load_average=9.0).oversubscribed  # one thread never spins


def test_doctor_renders_the_threads_and_what_to_set_when_oversubscribed():
    import dataclasses

    from vllm_port.doctor import render
    from vllm_port.host_threads import check_threads

    check = check_threads(cores=2, threads=2, load_average=4.0)
    report = {"api_version": "1.1", "plugins": [], "selected": None, "error": None, "ops": {}, "ok": True}
    report["threads"] = {**dataclasses.asdict(check), "oversubscribed": check.oversubscribed}
    text = render(report)
    assert "Host threads: 2 torch threads, 2 usable cores, load average 4.00" in text
    assert "! oversubscribed: 2 torch threads on 2 cores that other work keeps busy" in text
    assert "OMP_NUM_THREADS=1" in text
