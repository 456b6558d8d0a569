"""Strict mode: every fallback discovery, binding and the runtime would take on their own becomes an error."""

from __future__ import annotations

import pytest
import torch
from plugin_factory import healthy

import vllm_port
from vllm_port import cli, doctor_command
from vllm_port.discovery import discover
from vllm_port.errors import ProviderError, SelectionError, StrictModeError
from vllm_port.faults import strict_mode, unknown_settings

HANGING_PROBE = "import threading\n@hookimpl\ndef vllm_port_platform_probe():\n    threading.Event().wait()\n"


def test_a_plugin_discovery_skips_is_an_error_in_strict_mode_naming_it(install_plugin, monkeypatch):
    install_plugin("zbroken", "raise ImportError('libzbroken.so: cannot open shared object file')")
    assert vllm_port.load(plugins="cpu,zbroken").platform.name == "cpu"  # by default: skipped, recorded
    found = discover(plugins="cpu,zbroken")
    (problem,) = found.problems
    assert (
        problem.startswith("plugin 'zbroken' (vllm-port-test-zbroken 0.0.1) was skipped: import of")
        and "libzbroken" in problem
    )
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    with pytest.raises(
        StrictModeError, match=r"(?s)refuses what discovery would skip:\n  plugin 'zbroken'.*libzbroken"
    ):
        vllm_port.load(plugins="cpu,zbroken")


def test_a_hanging_probe_names_the_plugin_and_strict_mode_refuses_it(install_plugin):
    install_plugin("zhang", healthy("zhang", priority=99, extra=HANGING_PROBE))
    runtime = vllm_port.load(plugins="cpu,zhang", probe_timeout_s=0.2)
    assert runtime.platform.name == "cpu"
    assert (
        "plugin 'zhang': vllm_port_platform_probe did not answer within the 0.2 s limit"
        in runtime.discovery.problems[0]
    )
    with pytest.raises(StrictModeError, match="plugin 'zhang'.*did not answer within the 0.2 s limit"):
        discover(plugins="cpu,zhang", probe_timeout_s=0.2, strict=True)


def test_a_refused_provider_is_an_error_in_strict_mode(install_plugin):
    install_plugin(
        "zsig",
        "import dataclasses\nfrom vllm_port import hookimpl\nfrom vllm_port.ops import provider\n"
        "@hookimpl\ndef vllm_port_api_range():\n    return '>=1'\n"
        "@provider('rms_norm')\ndef renamed(x, w, eps):\n    return x\n"
        "@hookimpl\ndef vllm_port_providers():\n    return [dataclasses.replace(renamed, platform='cpu')]\n",
    )
    with pytest.raises(StrictModeError, match="plugin 'zsig': provider refused: provider 'renamed' of plugin 'zsig'"):
        discover(plugins="cpu,zsig", strict=True)


def test_unknown_settings_are_refused_in_strict_mode_but_a_plugins_own_are_not(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_DEVCE", "cpu")  # misspelt: silently ignored by default
    monkeypatch.setenv("VLLM_PORT_CPU_NATIVE", "0")  # the cpu plugin's own
    assert unknown_settings(["cpu"]) == ["VLLM_PORT_DEVCE"]
    assert discover(plugins="cpu").platforms()  # by default: a problem recorded, nothing stops
    with pytest.raises(
        StrictModeError,
        match=r"unknown setting VLLM_PORT_DEVCE \(did you mean VLLM_PORT_DEVICE\?\) \(vllm-port reads .*VLLM_PORT_DEVICE",
    ):
        discover(plugins="cpu", strict=True)


def test_an_excluded_plugin_whose_code_an_admitted_one_imports_is_refused(install_plugin):
    hidden = install_plugin("zhidden", healthy("zhidden"))
    install_plugin(
        "zloader",
        f"import {hidden}\n"
        + "from vllm_port import hookimpl\n@hookimpl\ndef vllm_port_api_range():\n    return '>=1'\n",
    )
    with pytest.raises(
        StrictModeError,
        match=f"plugin 'zhidden' is kept out by --plugins='cpu,zloader', but its module '{hidden}' was imported",
    ):
        discover(plugins="cpu,zloader", strict=True)


def test_unknown_names_in_the_settings_stay_errors(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    with pytest.raises(SelectionError, match="names 'cdua', but no installed plugin is called that"):
        discover(plugins="cpu,cdua")
    monkeypatch.setenv("VLLM_PORT_OP_PROVIDERS", "rms_nrom=reference")
    with pytest.raises(SelectionError, match="unknown ops"):
        vllm_port.load(plugins="cpu").bind(torch.float32)
    monkeypatch.setenv("VLLM_PORT_STRICT", "maybe")
    with pytest.raises(SelectionError, match="VLLM_PORT_STRICT='maybe' is not a switch"):
        strict_mode()


FLOAT32_ONLY = """
import torch
from vllm_port.ops import provider, rms_norm

@provider("rms_norm", priority=10, dtypes=[torch.float32])
def zhalf_rms_norm(x, weight, epsilon):
    return rms_norm.reference(x, weight, epsilon)

@provider("silu_and_mul", supports=lambda ctx: ctx.capabilities["no such key"])
def zhalf_silu_and_mul(x):
    return x

@hookimpl
def vllm_port_providers():
    return [zhalf_rms_norm, zhalf_silu_and_mul]
"""


def test_the_reference_in_place_of_the_platforms_kernel_is_refused_unless_asked_for(install_plugin):
    install_plugin("zhalf", healthy("zhalf", priority=50, extra=FLOAT32_ONLY))
    runtime = vllm_port.load(plugins="cpu,zhalf")
    kernels = runtime.bind(torch.bfloat16)
    assert kernels.providers["rms_norm"].name == "reference"
    assert any(
        "the reference serves torch.bfloat16 on 'zhalf'" in f and "zhalf_rms_norm" in f for f in kernels.fallbacks
    )
    # a support predicate that raises is a skip, recorded with the reason
    assert "its support predicate raised KeyError" in kernels.skipped["silu_and_mul"][0][1]
    with pytest.raises(StrictModeError, match=r"VLLM_PORT_OP_PROVIDERS=rms_norm=reference"):
        runtime.bind(torch.bfloat16, strict=True, prefer={"silu_and_mul": "reference"})
    asked = {"rms_norm": "reference", "silu_and_mul": "reference"}
    assert runtime.bind(torch.bfloat16, strict=True, prefer=asked).fallbacks == []
    assert runtime.bind(torch.float32, strict=True, prefer={"silu_and_mul": "reference"}).fallbacks == []


def test_a_preferred_provider_that_fails_its_smoke_check_is_an_error(faulty_runtime):
    runtime = faulty_runtime("wrong values")
    with pytest.raises(
        ProviderError, match="provider 'zf_rms_norm' of plugin 'zfaulty', named by the provider preferences"
    ):
        runtime.bind(torch.float32, prefer={"rms_norm": "zf_rms_norm"}, verify=True)


def test_strict_flag_goes_anywhere_before_a_double_dash_and_only_for_the_command(monkeypatch):
    assert cli.take_strict(["doctor", "--strict", "--json"]) == (["doctor", "--json"], True)
    assert cli.take_strict(["--strict", "generate", "--", "--strict"]) == (["generate", "--", "--strict"], True)
    assert cli.take_strict(["doctor"]) == (["doctor"], False)
    seen = {}

    def fake_doctor(args):
        import os

        seen["strict"] = os.environ.get("VLLM_PORT_STRICT")
        return 0

    monkeypatch.setattr(doctor_command, "run", fake_doctor)  # the table takes each command's run when it parses
    assert cli.main(["doctor", "--strict"]) == 0
    assert seen["strict"] == "1"
    import os

    assert "VLLM_PORT_STRICT" not in os.environ


def test_every_setting_the_code_reads_is_known_to_strict_mode():
    """A new ``VLLM_PORT_*`` variable must be added to ``vllm_port.faults.SETTINGS`` (or be a plugin's own,
    ``VLLM_PORT_<PLUGIN>_*``), or strict mode would refuse the feature's own switch."""
    import re
    from pathlib import Path

    from vllm_port.faults import SETTINGS

    repo = Path(__file__).resolve().parents[3]
    sources = [
        *repo.glob("core/src/**/*.py"),
        *repo.glob("conformance/src/**/*.py"),
        *repo.glob("plugins/*/src/**/*.py"),
    ]
    named = {m for path in sources for m in re.findall(r"\bVLLM_PORT_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    plugins = ("CPU", "CUDA", "ROCM", "XPU")
    unknown = sorted(
        n for n in named if n not in SETTINGS and not n.startswith(tuple(f"VLLM_PORT_{p}_" for p in plugins))
    )
    assert unknown == [], f"add these to vllm_port.faults.SETTINGS: {unknown}"
