"""Comm contract: every collective and point-to-point call of the plugin's communicator, across ranks.

The suite spawns the ranks itself (one spawn for the checks the run selected, results sent back per
check), on the platform's backend (gloo on CPU) with a short process-group timeout, so a broken call
fails instead of hanging. Two ranks where there are two devices (ranks of the host CPU share it); a
world of one on a one-device machine (or with ``--vllm-port-devices 1``), where the checks that need
a peer are recorded as out of scope. The rank side lives in :mod:`vllm_port_conformance.comm_ranks`.

Every call is checked for every dtype the contract allows, over every message size class and on
values of each dtype's whole width (int64 past 2^24, 2^31, 2^53; floats across their range), as
:mod:`vllm_port_conformance.comm_memory_classes` declares them.
"""

from __future__ import annotations

import pytest

from vllm_port.spawn import run_ranks
from vllm_port_conformance.comm_ranks import CHECK_NAMES, MULTI_RANK_CHECKS, comm_world_size, run_checks
from vllm_port_conformance.recorder import DEVICES_OPTION, out_of_scope

TIMEOUT_S = 30.0


def _selected(session: pytest.Session) -> tuple[str, ...]:
    """The checks of :func:`test_comm` this run holds: all of them, unless ``-k`` or ``--vllm-port-check`` chose some."""
    return tuple(
        item.callspec.params["check"]
        for item in session.items
        if isinstance(item, pytest.Function) and item.originalname == "test_comm" and item.module.__name__ == __name__
    )


@pytest.fixture(scope="module")
def comm_results(plugin, request) -> tuple[int, list[dict[str, str | None]]]:
    """``(world size, each rank's results)`` of one spawn of every check the run selected."""
    plugin.require_device()
    desc, probe = plugin.record.description, plugin.record.probe
    try:
        world = comm_world_size(desc.device_type, probe.device_count, request.config.getoption(DEVICES_OPTION, None))
    except ValueError as exc:
        raise pytest.UsageError(f"{DEVICES_OPTION}: {exc}") from exc
    results = run_ranks(
        run_checks,
        desc,
        world,
        args=(plugin.record.name, desc.name, _selected(request.session)),
        timeout_s=TIMEOUT_S,
        deadline_s=3 * TIMEOUT_S,
        device_count=probe.device_count,
    )
    return world, results


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_comm(plugin, comm_results, check, request):
    world, results = comm_results
    if world < 2 and check in MULTI_RANK_CHECKS:
        out_of_scope(request.node, f"{check} needs 2 ranks on 2 devices; this run certifies 1 device")
    for rank, got in enumerate(results):
        assert check in got, f"rank {rank} did not run {check}"
        assert got[check] is None, f"plugin {plugin.record.name!r}: {check}: {got[check]}"
