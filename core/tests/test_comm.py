"""The comm contract's defaults: validation without processes, then 2 gloo ranks for what needs peers."""

from __future__ import annotations

import os
import time

import pytest
import torch

import vllm_port
from vllm_port.comm import (
    COLLECTIVE_CALLS,
    P2P_CALLS,
    Communicator,
    DistContext,
    TorchCollectives,
    TorchPointToPoint,
    init_from_env,
)
from vllm_port.errors import CommCapabilityError, CommError, CommInitError, CommInputError, CommTimeoutError
from vllm_port.platform import PlatformDescription
from vllm_port.spawn import run_ranks

CPU = PlatformDescription(name="cpu", device_type="cpu", priority=0, dist_backend="gloo")
GPU = PlatformDescription(name="fakegpu", device_type="cuda", priority=0, dist_backend="nccl")


class NoReduceScatter(TorchCollectives):
    name = "partial"
    capabilities = TorchCollectives.capabilities - {"reduce_scatter"}


def test_default_parts_claim_every_call():
    comm = vllm_port.load(plugins="cpu", device="cpu").communicator()
    assert comm.point_to_point.capabilities == P2P_CALLS
    assert comm.collectives.capabilities == COLLECTIVE_CALLS
    assert set(comm.served_by_call.values()) == {"torch.distributed"}
    assert set(comm.served_by_call) == P2P_CALLS | COLLECTIVE_CALLS


def test_unclaimed_call_raises_before_any_communication():
    comm = Communicator(TorchPointToPoint(), NoReduceScatter())
    assert comm.served_by_call["reduce_scatter"] == "unclaimed"
    assert comm.served_by_call["all_reduce"] == "partial"
    with pytest.raises(CommCapabilityError, match="reduce_scatter is not served by 'partial'"):
        comm.reduce_scatter(torch.ones(4))


def test_calls_without_a_process_group_say_how_to_set_one_up():
    with pytest.raises(CommInitError, match="all_reduce.*init_from_env"):
        TorchCollectives().all_reduce(torch.ones(2))
    with pytest.raises(CommInitError, match="send"):
        TorchPointToPoint().send(torch.ones(2), 1)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_init_from_env_names_what_is_missing(clean_env):
    clean_env.setenv("RANK", "0")
    with pytest.raises(CommInitError, match=r"\$WORLD_SIZE, \$MASTER_ADDR, \$MASTER_PORT.*torchrun"):
        init_from_env(CPU, 5)


def test_init_from_env_refuses_bad_values(clean_env):
    clean_env.setenv("RANK", "x")
    for n, v in (("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        clean_env.setenv(n, v)
    with pytest.raises(CommInitError, match="RANK='x' is not an integer"):
        init_from_env(CPU, 5)
    clean_env.setenv("RANK", "2")
    with pytest.raises(CommInitError, match="inconsistent"):
        init_from_env(CPU, 5)


def test_init_from_env_refuses_more_ranks_per_node_than_devices(clean_env):
    for n, v in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        clean_env.setenv(n, v)
    clean_env.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(CommInitError, match="4 ranks per node but platform 'fakegpu' has 2 cuda device"):
        init_from_env(GPU, 5, device_count=2)


def test_init_from_env_takes_a_platform_description_and_names_the_runtime_method(clean_env):
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    with pytest.raises(CommInitError, match=r"platform is Runtime, not a PlatformDescription.*init_process_group"):
        init_from_env(runtime, 5)


def test_a_runtime_joins_the_process_group_with_its_platform_and_device_count(clean_env):
    import vllm_port.runtime as runtime_module

    runtime = vllm_port.load(plugins="cpu", device="cpu")
    with pytest.raises(CommInitError, match=r"the environment lacks \$RANK"):
        runtime.init_process_group(5)
    calls = []
    clean_env.setattr(runtime_module, "init_from_env", lambda *args: calls.append(args) or "joined")
    assert runtime.init_process_group(7.5) == "joined"
    assert calls == [(runtime.platform, 7.5, runtime.selected.probe.device_count)]


# -- on 2 gloo ranks: one spawn for the peer-dependent checks, one for a peer that never joins ----


def _checks(ctx: DistContext) -> dict[str, object]:
    comm = Communicator(TorchPointToPoint(), TorchCollectives())
    r = ctx.rank
    out: dict[str, object] = {"ctx": (ctx.rank, ctx.world_size, ctx.backend, str(ctx.device))}
    out["all_reduce"] = comm.all_reduce(torch.full((2,), r + 1.0)).tolist()
    out["gather_uneven_dim0"] = comm.all_gather(torch.full((r + 1, 2), float(r)), dim=0).tolist()
    out["reduce_scatter_uneven"] = comm.reduce_scatter(torch.arange(5.0).unsqueeze(1) * (r + 1), dim=0).tolist()
    try:
        comm.all_gather(torch.ones(2, r + 2), dim=0)
    except CommError as e:
        out["mismatch"] = f"{type(e).__name__}: {e}"
    try:
        comm.recv(torch.ones(2), src=5)
    except CommInputError as e:
        out["bad_src"] = str(e)
    comm.barrier()
    return out


@pytest.mark.slow
def test_collectives_on_two_gloo_ranks():
    r0, r1 = run_ranks(_checks, CPU, 2, timeout_s=20)
    assert r0["ctx"] == (0, 2, "gloo", "cpu") and r1["ctx"][0] == 1
    assert r0["all_reduce"] == r1["all_reduce"] == [3.0, 3.0]
    assert r0["gather_uneven_dim0"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert r0["reduce_scatter_uneven"] == [[0.0], [3.0], [6.0]]  # 5 rows: rank 0 gets 3
    assert r1["reduce_scatter_uneven"] == [[9.0], [12.0]]
    for res in (r0, r1):
        assert res["mismatch"].startswith("CommShapeMismatchError")
        assert "rank 0: float32[2, 2], rank 1: float32[2, 3]" in res["mismatch"]
    assert "rank 1: recv: src=5 is not a rank of the group (0..1)" in r1["bad_src"]


def _peer_missing(ctx: DistContext) -> str:
    if ctx.rank == 1:
        time.sleep(4)  # never joins the all_reduce within rank 0's timeout
        return "slept"
    start = time.monotonic()
    try:
        TorchCollectives().all_reduce(torch.ones(2))
    except CommTimeoutError as e:
        return f"{time.monotonic() - start:.1f}s {e}"
    return "no error"


@pytest.mark.slow
def test_a_rank_that_never_joins_ends_in_a_timeout_error():
    r0, _ = run_ranks(_peer_missing, CPU, 2, timeout_s=2, deadline_s=60)
    assert "rank 0: all_reduce" in r0 and "timeout" in r0, r0
    assert float(r0.split("s ", 1)[0]) < 4


def _peer_dies(ctx: DistContext) -> str:
    if ctx.rank == 1:
        os._exit(0)
    try:
        TorchCollectives().all_gather(torch.ones(2))
    except CommTimeoutError as e:
        raise CommTimeoutError(str(e)) from None
    return "no error"


@pytest.mark.slow
def test_a_rank_that_dies_ends_in_an_error_naming_the_call():
    start = time.monotonic()
    with pytest.raises(CommError, match=r"rank 1 exited \(code 0\) without a result") as info:
        run_ranks(_peer_dies, CPU, 2, timeout_s=3, deadline_s=30)
    assert time.monotonic() - start < 20
    assert "rank 0 failed" not in str(info.value) or "rank 0: all_gather" in str(info.value)
