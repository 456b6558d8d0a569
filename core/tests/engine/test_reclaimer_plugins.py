"""The reclaimer is a contract part: a plugin replaces it alone, the engine obeys it, conformance judges it.

Test plugins are installed for real (``plugin_factory``): one adds only a reclaimer to the CPU
platform; one is a platform with a host memory tier (swap space) whose reclaimer always swaps; one
has a reclaimer that breaks the rules, which the engine and the conformance check both refuse.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from llm_helpers import assert_pool_empty, make_llm, token_ids
from plugin_factory import healthy

import vllm_port
from vllm_port.errors import MemoryContractError
from vllm_port.reclaimer import DefaultReclaimer

#: A plugin that is no platform: it only replaces the reclaimer, recording what it is asked.
RECORDING = """
from vllm_port import hookimpl
from vllm_port.reclaimer import Preemption, ReclaimPlan

ASKED = []

class NewestFirst:
    '''Preempts the newest request first, always by recompute; evicts the most recently cached blocks first.'''

    def plan(self, pressure):
        ASKED.append(pressure)
        short = pressure.need - pressure.free
        evict = pressure.cached[::-1][: max(short, 0)]
        short -= len(evict)
        preempt = []
        for c in sorted(pressure.candidates, key=lambda c: -c.arrival):
            if short <= 0:
                break
            preempt.append(Preemption(c.request_id, "recompute"))
            short -= c.num_freed
        return ReclaimPlan(tuple(evict), tuple(preempt))

@hookimpl
def vllm_port_api_range():
    return ">=1.1,<2"

@hookimpl
def vllm_port_reclaimer(platform):
    return NewestFirst()
"""

#: A CPU platform with a host tier for swap space; its reclaimer swaps whatever fits.
SWAPPING = healthy(
    "swapcpu",
    priority=1,
    extra="""
import dataclasses
from vllm_port.reclaimer import DefaultReclaimer
from vllm_port_cpu import ops as cpu_ops

@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(
        name=PLATFORM, device_type="cpu", priority=PRIORITY, dist_backend="gloo", memory_tiers=("device", "host")
    )

@hookimpl
def vllm_port_providers():
    return [dataclasses.replace(p, name=p.name + "_swapcpu", platform="") for p in cpu_ops.PROVIDERS]

@hookimpl
def vllm_port_reclaimer(platform):
    return DefaultReclaimer(swap_min_tokens=0) if platform.name == PLATFORM else None
""",
)

#: A platform whose reclaimer evicts block 0 whatever it is asked (a block in use, as often as not).
BROKEN = healthy(
    "badreclaim",
    extra="""
from vllm_port.reclaimer import ReclaimPlan

class EvictsBlockZero:
    def plan(self, pressure):
        return ReclaimPlan(evict=(0,))

@hookimpl
def vllm_port_reclaimer(platform):
    return EvictsBlockZero()
""",
)

PRESSURE = dict(block_size=4, kv_cache_memory=16 * 4096, max_model_len=64)


@pytest.mark.slow
def test_a_plugin_replaces_the_reclaimer_alone_and_the_engine_follows_it(install_plugin, llama_model, alone):
    module = install_plugin("newestfirst", RECORDING)
    runtime = vllm_port.load(plugins="cpu,newestfirst")
    assert runtime.platform.name == "cpu"  # the platform is the CPU plugin's; only the policy is replaced
    assert type(runtime.reclaimer()).__name__ == "NewestFirst" and runtime.reclaimer_plugin == "newestfirst"
    batch, params, want = alone
    llm = make_llm(llama_model, runtime, **PRESSURE)
    outputs = llm.generate(batch, params)
    assert token_ids(outputs) == want
    asked = sys.modules[module].ASKED
    assert any(p.candidates for p in asked), "the engine never asked the plugin's reclaimer to preempt"
    assert sum(o.num_preemptions for o in outputs) > 0
    assert_pool_empty(llm)


def test_preemption_by_swap_keeps_greedy_output(install_plugin, llama_model, alone):
    install_plugin("swapcpu", SWAPPING)
    runtime = vllm_port.load(plugins="cpu,swapcpu", device="swapcpu")
    assert isinstance(runtime.reclaimer(), DefaultReclaimer) and runtime.reclaimer_plugin == "swapcpu"
    batch, params, want = alone
    llm = make_llm(llama_model, runtime, swap_space=64 * 4096, **PRESSURE)
    assert llm.scheduler.swap_pool is not None and llm.provider_per_op["linear"].endswith("_swapcpu")
    swaps = []
    execute = llm.runner.execute
    llm.runner.execute = lambda batch: swaps.append((len(batch.swap_out), len(batch.swap_in))) or execute(batch)
    outputs = llm.generate(batch, params)
    assert token_ids(outputs) == want
    assert sum(o for o, _ in swaps) > 0 and sum(i for _, i in swaps) > 0
    assert_pool_empty(llm)


def test_swap_space_needs_a_host_tier(llama_model, cpu_runtime):
    with pytest.raises(MemoryContractError, match="platform 'cpu' has no host tier to swap to"):
        make_llm(llama_model, cpu_runtime, swap_space=1 << 20)


def test_a_reclaimer_breaking_the_rules_stops_the_engine_naming_its_plugin(install_plugin, llama_model, alone):
    install_plugin("badreclaim", BROKEN)
    runtime = vllm_port.load(plugins="cpu,badreclaim", device="badreclaim")
    llm = make_llm(llama_model, runtime, **PRESSURE)
    batch, params, _ = alone
    with pytest.raises(
        MemoryContractError, match=r"plugin 'badreclaim'.*evicts block\(s\) \[0\], which are not cached-free"
    ):
        llm.generate(batch, params)


@pytest.mark.slow
def test_conformance_fails_a_reclaimer_breaking_the_rules(install_plugin):
    install_plugin("badreclaim", BROKEN)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "-x",
    ]  # -x stops one process
    cmd += ["--pyargs", "vllm_port_conformance.checks.test_reclaimer", "--vllm-port-plugin", "badreclaim"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "plugin 'badreclaim': reclaimer EvictsBlockZero" in proc.stdout and "not cached-free" in proc.stdout
