"""The pytest plugin: the ``--vllm-port-plugin`` option, the plugin-under-test fixtures, and test generation.

Ops checks are generated from the registry: one case per provider the plugin registered, per dtype
it claims, per sample input of the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import vllm_port
from vllm_port.discovery import Discovery, PluginRecord, discover

OPTION = "--vllm-port-plugin"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vllm-port", "vllm-port conformance")
    group.addoption(OPTION, default=None, help="name of the installed vllm-port plugin to certify (e.g. cpu)")


@dataclass(frozen=True)
class PluginUnderTest:
    """The plugin being checked: its discovery record and the discovery it came from."""

    record: PluginRecord
    discovery: Discovery
    #: the plugin's ``vllm_port_platform_context_created`` answer right after discovery and the
    #: probe, before any check touched the device (``None`` if it does not implement the hook)
    context_after_probe: bool | None

    @property
    def device(self) -> torch.device:
        desc = self.record.description
        if desc is None or desc.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(desc.device_type, 0)

    def require_device(self) -> None:
        """Skip the calling check when the platform is absent here, saying why."""
        if not self.record.available:
            pytest.skip(f"device absent: {self.record.reason}")

    def runtime(self) -> vllm_port.Runtime:
        self.require_device()
        return vllm_port.Runtime(self.discovery, self.record, "under conformance test")


_cache: dict[str, PluginUnderTest] = {}


def plugin_under_test(config: pytest.Config) -> PluginUnderTest | None:
    """Discover the plugin named by ``--vllm-port-plugin`` once per session."""
    name = config.getoption(OPTION)
    if not name:
        return None
    if name not in _cache:
        found = discover(plugins=name)
        module = found.manager.get_plugin(name)
        hook = getattr(module, "vllm_port_platform_context_created", None)
        context = bool(hook()) if hook is not None else None
        _cache[name] = PluginUnderTest(next(r for r in found.plugins if r.name == name), found, context)
    return _cache[name]


@pytest.fixture(scope="session")
def plugin(request: pytest.FixtureRequest) -> PluginUnderTest:
    """The plugin under test; a usage error when ``--vllm-port-plugin`` is missing."""
    found = plugin_under_test(request.config)
    if found is None:
        raise pytest.UsageError(f"the vllm-port conformance checks need {OPTION} NAME (an installed plugin, e.g. cpu)")
    return found


def _provider_cases(put: PluginUnderTest) -> list[Any]:
    cases = []
    for p in put.record.providers:
        for dtype in sorted(p.dtypes, key=str):
            cases.append(pytest.param((p, dtype), id=f"{p.op}-{p.name}-{str(dtype).removeprefix('torch.')}"))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "provider_case" not in metafunc.fixturenames:
        return
    put = plugin_under_test(metafunc.config)
    cases = _provider_cases(put) if put else []
    metafunc.parametrize(
        "provider_case",
        cases or [pytest.param(None, marks=pytest.mark.skip(reason="the plugin registers no providers"))],
    )
