"""Platform contract: the description and the probe are well formed, consistent and cheap."""

from __future__ import annotations

import time

from vllm_port import hookspecs
from vllm_port.platform import validate_description, validate_probe

PROBE_BUDGET_S = 0.5  # a repeated probe is a cheap query, not a device initialisation


def _call(plugin, hook):
    module = plugin.discovery.manager.get_plugin(plugin.record.name)
    return getattr(module, hook)()


def test_plugin_loaded_without_error(plugin):
    assert plugin.record.error is None, plugin.record.error
    assert not plugin.record.rejected, "providers refused at registration:\n" + "\n".join(plugin.record.rejected)


def test_description_is_well_formed(plugin):
    assert plugin.record.description is not None, f"plugin {plugin.record.name!r} is not a platform plugin"
    validate_description(_call(plugin, "vllm_port_platform_describe"))


def test_probe_is_consistent_and_cheap(plugin):
    first = validate_probe(_call(plugin, "vllm_port_platform_probe"))
    start = time.perf_counter()
    second = validate_probe(_call(plugin, "vllm_port_platform_probe"))
    elapsed = time.perf_counter() - start
    assert (first.available, first.device_count) == (second.available, second.device_count), "two probes disagree"
    assert elapsed < PROBE_BUDGET_S, f"a repeated probe took {elapsed:.3f}s; probes must be cheap queries"


def test_probe_creates_no_device_context(plugin):
    # Answered at collection, right after discovery probed, before any check touched the device.
    if plugin.context_after_probe is None:
        assert plugin.record.description.device_type == "cpu", (
            "a device platform must implement vllm_port_platform_context_created"
        )
        return
    assert plugin.context_after_probe is False, "discovery and the probe created a device context"


def test_api_range_is_declared(plugin):
    assert hookspecs.REQUIRED_HOOKS == ("vllm_port_api_range",)
    assert plugin.record.api_range


def test_platform_selects_when_available(plugin):
    runtime = plugin.runtime()
    assert runtime.platform.name == plugin.record.description.name
