"""Discovery and selection against real installed plugins, healthy and broken in every way we know."""

import pytest
from cpu_providers import cpu_provider
from plugin_factory import healthy

import vllm_port
from vllm_port.discovery import discover, parse_plugin_filter
from vllm_port.errors import SelectionError
from vllm_port.runtime import select


def _record(found, name):
    return next(r for r in found.plugins if r.name == name)


def test_installed_cpu_plugin_is_discovered_and_selected():
    runtime = vllm_port.load(plugins="cpu")
    assert runtime.platform.name == "cpu"
    assert runtime.selected.available and runtime.selected.version
    assert "highest priority" in runtime.reason


def test_healthy_test_plugin_with_higher_priority_wins(install_plugin):
    install_plugin("fast", healthy("fast", priority=50))
    runtime = vllm_port.load(plugins="cpu,fast")
    assert runtime.platform.name == "fast"
    assert "fast (50), cpu (0)" in runtime.reason


def test_a_negative_priority_is_valid_and_ranks_below_the_cpu_plugin(install_plugin):
    """Where ``new-plugin`` starts a package (below every in-tree plugin): discovered, available, never chosen."""
    install_plugin("humble", healthy("humble", priority=-1))
    runtime = vllm_port.load(plugins="cpu,humble")
    record = _record(runtime.discovery, "humble")
    assert record.error is None and record.available and record.description.priority == -1
    assert runtime.platform.name == "cpu" and "cpu (0), humble (-1)" in runtime.reason
    assert vllm_port.load(plugins="cpu,humble", device="humble").platform.name == "humble"  # named, it runs


def test_device_flag_and_env_override_priority(install_plugin, monkeypatch):
    install_plugin("fast", healthy("fast", priority=50))
    assert vllm_port.load(plugins="cpu,fast", device="cpu").platform.name == "cpu"
    monkeypatch.setenv("VLLM_PORT_DEVICE", "cpu")
    runtime = vllm_port.load(plugins="cpu,fast")
    assert runtime.platform.name == "cpu" and "VLLM_PORT_DEVICE" in runtime.reason


BROKEN = {
    "import error": ("raise ImportError('libfoo.so: cannot open shared object file')", "import of"),
    "exit at import": ("import sys; sys.exit(3)", "SystemExit"),
    "hook with a wrong signature": (
        healthy(extra="@hookimpl\ndef vllm_port_allocator(platform, device_index):\n    return None\n"),
        "does not match the hook specs",
    ),
    "misspelt hook": (
        healthy(extra="@hookimpl\ndef vllm_port_provider():\n    return []\n"),
        "vllm_port_provider, which the contract does not define",
    ),
    "no api range": (
        "from vllm_port import hookimpl\n@hookimpl\ndef vllm_port_providers():\n    return []\n",
        "required hook vllm_port_api_range",
    ),
    "api range excluding core": (
        healthy(extra="@hookimpl\ndef vllm_port_api_range():\n    return '>=2.0,<3'\n"),
        f"supports contract API >=2.0,<3, but core is {vllm_port.API_VERSION}",
    ),
    "unparsable api range": (
        healthy(extra="@hookimpl\ndef vllm_port_api_range():\n    return 'latest'\n"),
        "invalid range",
    ),
    "probe raising": (
        healthy(extra="@hookimpl\ndef vllm_port_platform_probe():\n    raise RuntimeError('driver went away')\n"),
        "vllm_port_platform_probe raised RuntimeError: driver went away",
    ),
    "probe returning a dict": (
        healthy(extra="@hookimpl\ndef vllm_port_platform_probe():\n    return {'available': True}\n"),
        "must return a ProbeResult, got dict",
    ),
    "probe available without devices": (
        healthy(extra="@hookimpl\ndef vllm_port_platform_probe():\n    return ProbeResult(True, 'yes')\n"),
        "available=True but lists no devices",
    ),
    "probe with NaN capability": (
        healthy(
            extra="@hookimpl\ndef vllm_port_platform_probe():\n    return ProbeResult(False, 'no', (), {'tflops': float('nan')})\n"
        ),
        "is not a JSON value",
    ),
    "describe without probe": (
        "from vllm_port import PlatformDescription, hookimpl\n"
        "@hookimpl\ndef vllm_port_api_range():\n    return '>=1'\n"
        "@hookimpl\ndef vllm_port_platform_describe():\n    return PlatformDescription('x', 'cpu', 1, 'gloo')\n",
        "must implement both",
    ),
    "describe with a bad name": (
        healthy(
            extra="@hookimpl\ndef vllm_port_platform_describe():\n    return PlatformDescription('my gpu!', 'cpu', 1, 'gloo')\n"
        ),
        "name must be a non-empty identifier",
    ),
    "describe with a kv_head_major that is no bool": (
        healthy(
            extra="@hookimpl\ndef vllm_port_platform_describe():\n"
            "    return PlatformDescription('x', 'cpu', 1, 'gloo', kv_head_major='yes')\n"
        ),
        "kv_head_major must be a bool, got 'yes'",
    ),
    "platform name taken": (healthy("cpu"), "describes platform 'cpu', which plugin 'cpu' already provides"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_plugin_is_recorded_by_name_and_the_rest_keep_working(install_plugin, case):
    source, message = BROKEN[case]
    install_plugin("zbroken", source)
    found = discover(plugins="cpu,zbroken")
    broken = _record(found, "zbroken")
    assert not broken.available
    assert message in broken.error
    assert broken.distribution == "vllm-port-test-zbroken"
    runtime = vllm_port.load(plugins="cpu,zbroken")
    assert runtime.platform.name == "cpu"
    assert runtime.bind(__import__("torch").float32).rms_norm is not None


def test_unknown_plugin_name_is_an_error_naming_what_is_installed(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_PLUGINS", "cpu,cdua")
    with pytest.raises(SelectionError, match=r"VLLM_PORT_PLUGINS='cpu,cdua' names 'cdua'.*installed plugins: .*cpu"):
        discover()
    with pytest.raises(SelectionError, match=r"--plugins='nope' names 'nope'"):
        discover(plugins="nope")


def test_deny_list_excludes_and_reports(install_plugin):
    install_plugin("fast", healthy("fast", priority=50))
    found = discover(plugins="-fast")
    assert "fast" in found.excluded and all(r.name != "fast" for r in found.plugins)
    assert parse_plugin_filter(" cpu, -xpu ,") == ({"cpu"}, {"xpu"})


def test_unknown_device_is_an_error_listing_platforms(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_DEVICE", "tpu")
    with pytest.raises(SelectionError, match=r"VLLM_PORT_DEVICE='tpu' names no installed platform; platforms: .*cpu"):
        vllm_port.load(plugins="cpu")


def test_named_unavailable_device_says_why(install_plugin):
    install_plugin(
        "gone",
        healthy(
            "gone",
            extra="@hookimpl\ndef vllm_port_platform_probe():\n    return ProbeResult(False, 'no gone device: plug one in')\n",
        ),
    )
    with pytest.raises(SelectionError, match="--device='gone' is not available: no gone device: plug one in"):
        vllm_port.load(plugins="cpu,gone", device="gone")


def test_nothing_available_is_an_error_with_every_reason(install_plugin):
    install_plugin(
        "gone",
        healthy(
            "gone", extra="@hookimpl\ndef vllm_port_platform_probe():\n    return ProbeResult(False, 'unplugged')\n"
        ),
    )
    with pytest.raises(SelectionError, match="no platform is available here. gone: unplugged"):
        select(discover(plugins="gone"))


def test_a_broken_plugin_cannot_be_selected_by_name(install_plugin):
    install_plugin(
        "zbroken",
        healthy("zbroken", extra="@hookimpl\ndef vllm_port_platform_probe():\n    raise OSError('no sysfs')\n"),
    )
    with pytest.raises(SelectionError, match="names no installed platform"):
        vllm_port.load(plugins="cpu,zbroken", device="zbroken")


PROVIDERS = """
import torch
from vllm_port.ops import provider

@provider("rms_norm", priority=100)
def good_rms_norm(x, weight, epsilon):
    return x

@provider("rms_norm", priority=100)
def renamed_args(x, w, eps):
    return x

@provider("layer_norm")
def unknown_op(x):
    return x

@provider("silu_and_mul", dtypes=[torch.int8])
def int_claim(x):
    return x

@hookimpl
def vllm_port_providers():
    return [good_rms_norm, renamed_args, unknown_op, int_claim, "not a provider"]
"""


def test_providers_breaking_the_contract_are_refused_and_the_rest_count(install_plugin):
    install_plugin("fast", healthy("fast", extra=PROVIDERS))
    record = _record(discover(plugins="cpu,fast"), "fast")
    assert record.error is None
    assert [p.name for p in record.providers] == ["good_rms_norm"]
    rejected = "\n".join(record.rejected)
    assert "provider 'renamed_args' of plugin 'fast' has signature rms_norm(x, w, eps)" in rejected
    assert "rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float)" in rejected
    assert "op 'layer_norm', which the contract does not define" in rejected
    assert "claims dtypes ['torch.int8']" in rejected
    assert "returned 'not a provider'" in rejected


def test_providers_bind_only_on_their_platform(install_plugin):
    import torch

    install_plugin("fast", healthy("fast", extra=PROVIDERS))
    assert (
        vllm_port.load(plugins="cpu,fast", device="fast").bind(torch.float32).providers["rms_norm"].name
        == "good_rms_norm"
    )
    assert vllm_port.load(plugins="cpu,fast", device="cpu").bind(torch.float32).providers[
        "rms_norm"
    ].name == cpu_provider("rms_norm")


def test_allocator_and_comm_parts_are_replaceable_one_at_a_time(install_plugin):
    install_plugin(
        "fastcomm",
        "from vllm_port import hookimpl\nfrom vllm_port.comm import TorchCollectives\n"
        "class Mine(TorchCollectives):\n    name = 'fastcomm collectives'\n"
        "@hookimpl\ndef vllm_port_api_range():\n    return '>=1'\n"
        "@hookimpl\ndef vllm_port_collectives(platform):\n    return Mine()\n",
    )
    runtime = vllm_port.load(plugins="cpu,fastcomm")
    assert runtime.communicator().served_by == {
        "point_to_point": "torch.distributed",
        "collectives": "fastcomm collectives",
    }
    assert _record(runtime.discovery, "fastcomm").reason.startswith("not a platform plugin")


# -------------------------------------------------------------------------------------------------
# Probes under a time limit
# -------------------------------------------------------------------------------------------------

HANGING_PROBE = (
    "import threading\n"
    "@hookimpl\ndef vllm_port_platform_probe():\n    threading.Event().wait()  # a driver lock nobody releases\n"
)


def test_a_hanging_probe_is_recorded_unavailable_naming_the_plugin_and_the_limit(install_plugin):
    import time

    install_plugin("zhang", healthy("zhang", priority=99, extra=HANGING_PROBE))
    start = time.perf_counter()
    runtime = vllm_port.load(plugins="cpu,zhang", probe_timeout_s=0.3)
    assert time.perf_counter() - start < 5, "a hanging probe stalled load()"
    assert runtime.platform.name == "cpu"  # the higher priority of the hung platform does not count
    hung = _record(runtime.discovery, "zhang")
    assert not hung.available and 0.3 <= hung.probe_s < 2
    assert "plugin 'zhang': vllm_port_platform_probe did not answer within the 0.3 s limit" in hung.error
    assert "VLLM_PORT_PROBE_TIMEOUT" in hung.error
    assert _record(runtime.discovery, "cpu").probe_s < 0.3


def test_the_probe_limit_comes_from_the_environment_and_is_checked(monkeypatch):
    from vllm_port.discovery import DEFAULT_PROBE_TIMEOUT_S, probe_timeout

    monkeypatch.delenv("VLLM_PORT_PROBE_TIMEOUT", raising=False)
    assert probe_timeout() == DEFAULT_PROBE_TIMEOUT_S == discover(plugins="cpu").probe_timeout_s
    monkeypatch.setenv("VLLM_PORT_PROBE_TIMEOUT", "2.5")
    assert probe_timeout() == 2.5 and probe_timeout(1) == 1.0
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv("VLLM_PORT_PROBE_TIMEOUT", bad)
        with pytest.raises(SelectionError, match=f"VLLM_PORT_PROBE_TIMEOUT='{bad}' is not a time limit"):
            discover(plugins="cpu")
    with pytest.raises(SelectionError, match="probe_timeout_s=0 is not a time limit; give a positive number"):
        probe_timeout(0)


def test_a_probe_that_exits_is_recorded_not_obeyed(install_plugin):
    install_plugin(
        "zexit", healthy("zexit", extra="@hookimpl\ndef vllm_port_platform_probe():\n    raise SystemExit(3)\n")
    )
    record = _record(discover(plugins="cpu,zexit"), "zexit")
    assert not record.available and "vllm_port_platform_probe raised SystemExit: 3" in record.error


@pytest.mark.slow
def test_load_with_a_hanging_probe_returns_and_the_process_exits(install_plugin):
    """The hung probe's thread is a daemon: it neither stalls ``load()`` nor keeps the process alive at exit
    (``doctor`` discovers through the same path)."""
    import os
    import subprocess
    import sys

    install_plugin("zhang", healthy("zhang", priority=99, extra=HANGING_PROBE))
    code = "import vllm_port; r = vllm_port.load(plugins='cpu,zhang'); print(r.platform.name, r.discovery.plugins[1].error)"
    env = {**os.environ, "VLLM_PORT_PROBE_TIMEOUT": "0.5"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cpu plugin 'zhang': vllm_port_platform_probe did not answer within the 0.5 s limit")
