"""Memory and comm parts that misbehave: an allocator that lies about free memory, a communicator that times out."""

from __future__ import annotations

import pytest
import torch
from faulty_plugins import TIMING_OUT_COMM, lying_allocator

import vllm_port
from vllm_port.errors import CommInitError, CommTimeoutError, StrictModeError, VllmPortError
from vllm_port.memory import KVLayout

#: what ``_mem_info`` answers -> what the runtime says is wrong with it
LIES = {
    "more free than total": ("return (2 << 40, 1 << 40)", "must hold 0 <= free <= total"),
    "negative": ("return (-1, 1 << 30)", "free=-1 and total=1,073,741,824 bytes"),
    "not ints": ("return (1.5e9, 2e9)", "both must be ints of bytes"),
    "more than the host has": ("return (1 << 50, 1 << 50)", "but the device has"),
    "raises": ("raise OSError('no /dev/zmem0')", "mem_info() raised OSError: no /dev/zmem0"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_an_allocator_that_lies_gives_way_to_cores_and_strict_mode_refuses(install_plugin, lie, monkeypatch):
    source, said = LIES[lie]
    install_plugin("zmem", lying_allocator(source))
    runtime = vllm_port.load(plugins="cpu,zmem")
    assert runtime.platform.name == "zmem"
    allocator = runtime.allocator()
    assert allocator.name == "host allocator (core's default)"  # core's for the cpu device type
    (fallback,) = runtime.fallbacks
    assert "platform 'zmem': the allocator 'zmem allocator' of plugin 'zmem'" in fallback and said in fallback
    free, total = allocator.mem_info()
    assert 0 < free <= total
    kv = runtime.kv_cache(KVLayout(2, 2, 64, 16, torch.float32), 1 << 20)  # the engine's cache still comes up
    assert kv.num_blocks > 0
    kv.close()
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    strict = vllm_port.load(plugins="cpu,zmem")  # the plugin loads: its allocator is refused when asked for
    with pytest.raises(
        StrictModeError, match="(?s)allocator 'zmem allocator' of plugin 'zmem'.*Fix _mem_info in plugin 'zmem'"
    ):
        strict.allocator()


def test_an_honest_allocator_is_kept(install_plugin):
    install_plugin("zmem", lying_allocator("return (1 << 20, 1 << 30)"))
    runtime = vllm_port.load(plugins="cpu,zmem")
    assert runtime.allocator().name == "zmem allocator" and runtime.fallbacks == []


def test_a_communicator_that_times_out_names_the_plugin_the_call_and_the_way_out(install_plugin):
    install_plugin("zcomm", TIMING_OUT_COMM)
    comm = vllm_port.load(plugins="cpu,zcomm").communicator()
    assert comm.served_by == {"point_to_point": "torch.distributed", "collectives": "zcomm collectives"}
    tensor = torch.ones(4)
    with pytest.raises(
        CommTimeoutError, match=r"all_reduce of collectives part 'zcomm' timed out \(RuntimeError: .*Timed out"
    ):
        comm.all_reduce(tensor)
    with pytest.raises(
        CommTimeoutError, match=r"barrier of collectives part 'zcomm' timed out.*VLLM_PORT_PLUGINS=-zcomm"
    ):
        comm.barrier()
    with pytest.raises(
        VllmPortError, match=r"broadcast of collectives part 'zcomm' failed \(ValueError: descriptor table full\)"
    ):
        comm.broadcast(tensor, 0)
    # the caller's setup keeps the contract's own message: no process group was made here
    with pytest.raises(CommInitError, match="no default process group"):
        comm.all_gather(tensor)
