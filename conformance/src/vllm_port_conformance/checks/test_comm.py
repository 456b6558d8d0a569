"""Comm contract: every collective and point-to-point call of the plugin's communicator, on 2 ranks.

The suite spawns the ranks itself (one spawn for every check, results sent back per check), on the
platform's backend (gloo on CPU) with a short process-group timeout, so a broken call fails instead
of hanging. The rank side lives in :mod:`vllm_port_conformance.comm_ranks`.
"""

from __future__ import annotations

import pytest

from vllm_port.spawn import run_ranks
from vllm_port_conformance.comm_ranks import DTYPES, run_checks

WORLD_SIZE = 2
TIMEOUT_S = 30.0

_NAMES = [
    f"{name}[{str(dt).removeprefix('torch.')}]"
    for dt in DTYPES
    for name in ("all_reduce", "all_gather", "all_gather_uneven", "reduce_scatter", "broadcast")
] + [
    "non_contiguous",
    "shape_mismatch",
    "bad_input",
    "p2p_ring",
    "replaced_collectives_keep_p2p",
    "barrier",
    "tp_mlp",
]


@pytest.fixture(scope="module")
def comm_results(plugin):
    plugin.require_device()
    desc, probe = plugin.record.description, plugin.record.probe
    if desc.device_type != "cpu" and probe.device_count < WORLD_SIZE:
        pytest.skip(
            f"device absent: the comm checks need {WORLD_SIZE} {desc.device_type} devices, found {probe.device_count}"
        )
    return run_ranks(
        run_checks,
        desc,
        WORLD_SIZE,
        args=(plugin.record.name, desc.name),
        timeout_s=TIMEOUT_S,
        deadline_s=3 * TIMEOUT_S,
        device_count=probe.device_count,
    )


@pytest.mark.parametrize("check", _NAMES)
def test_comm(comm_results, check):
    for rank, results in enumerate(comm_results):
        assert check in results, f"rank {rank} did not run {check}"
        assert results[check] is None, results[check]
