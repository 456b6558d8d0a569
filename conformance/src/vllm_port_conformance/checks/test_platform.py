"""Platform contract: the description and the probe are well formed, consistent, cheap and quick.

The suite runs in a fresh process (``vllm-port certify`` starts one), and its discovery of the plugin
is that process's first probe: the time it took is checked against discovery's probe limit and
recorded in the report, so a probe that is slow only the first time (a lazy import, a driver that
starts) cannot pass on the repeated, warm probes alone. Every probe the checks make themselves runs
under the same limit, so a probe that hangs fails a check instead of stalling the suite.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from vllm_port import hookspecs
from vllm_port.platform import validate_description, validate_probe

PROBE_BUDGET_S = 0.5  # a repeated probe is a cheap query, not a device initialisation


def _call(plugin, hook: str) -> Any:
    """Call the plugin's own ``hook`` under discovery's probe limit; fail naming the plugin if it hangs."""
    name = plugin.record.name
    assert plugin.record.error is None, _named(plugin, f"did not load: {plugin.record.error}")
    module = plugin.discovery.manager.get_plugin(name)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(getattr(module, hook)())
        except Exception as exc:
            outcome.extend((None, exc))

    limit = plugin.discovery.probe_timeout_s
    thread = threading.Thread(target=run, name=f"conformance {hook}", daemon=True)  # left behind if it hangs
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"plugin {name!r}: {hook} did not answer within the {limit:g} s probe limit"
    if len(outcome) == 2:
        raise AssertionError(f"plugin {name!r}: {hook} raised {type(outcome[1]).__name__}: {outcome[1]}")
    return outcome[0]


def _named(plugin, message: str | None) -> str:
    """``message`` starting with the plugin's name (discovery's messages may already)."""
    who = f"plugin {plugin.record.name!r}"
    return str(message) if str(message).startswith(who) else f"{who}: {message}"


def test_plugin_loaded_without_error(plugin):
    assert plugin.record.error is None, _named(plugin, plugin.record.error)
    assert not plugin.record.rejected, "providers refused at registration:\n" + "\n".join(plugin.record.rejected)


def test_description_is_well_formed(plugin):
    assert plugin.record.description is not None, f"plugin {plugin.record.name!r} is not a platform plugin"
    validate_description(_call(plugin, "vllm_port_platform_describe"))


def test_first_probe_of_a_fresh_process_is_within_the_limit(plugin, record_property):
    took, limit = plugin.record.probe_s, plugin.discovery.probe_timeout_s
    record_property("first_probe_s", took)
    record_property("probe_limit_s", limit)
    assert took is not None, f"plugin {plugin.record.name!r} was never probed: {plugin.record.reason}"
    assert took < limit, (
        f"plugin {plugin.record.name!r}: the first probe of a fresh process took {took:.3f} s, over the "
        f"{limit:g} s probe limit; a probe must be a cheap query even the first time (no imports that "
        "hang, no device start-up)"
    )


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
