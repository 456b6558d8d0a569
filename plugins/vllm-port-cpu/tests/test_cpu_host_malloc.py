"""Binding the CPU platform's ops tells glibc's malloc to keep freed buffers: up to 256 MiB they come from the heap.

The mechanism is seen in a fresh process (malloc's parameters are the process's): glibc serves the
first 4 MiB buffer with an ``mmap`` of its own (its default threshold is 128 KiB), and one asked for
after the CPU ops are bound from the heap, where a freed buffer serves the next one instead of being
unmapped and faulted in again; a 64 MiB one too where glibc takes a threshold above 32 MiB. What that saves is measured in docs/results/bridge-cpu.md. The cases that
leave malloc alone (the switch off, malloc settings in the environment) are checked on the decision alone;
``core/tests/faults/test_settings.py`` checks that the plugin declares the switch.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from vllm_port.errors import SelectionError
from vllm_port_cpu import host_malloc

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

FROM_THE_HEAP = """
import json, torch

def from_the_heap(buffer):
    # glibc serves a request under its mmap threshold from the heap ([heap] in the maps), above it with its own mmap
    address = buffer.data_ptr()
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return True
    return False

before = torch.empty(1 << 20)  # 4 MiB, the first buffer this large: over the default threshold of 128 KiB
import vllm_port
vllm_port.load(plugins="cpu").bind(torch.float32)  # binding the CPU ops applies the thresholds
after = torch.empty(1 << 20)
large = torch.empty(16 << 20)  # 64 MiB: a prefill's activation, above older glibc's largest threshold
from vllm_port_cpu import host_malloc
print(json.dumps({"before": from_the_heap(before), "after": from_the_heap(after), "large": from_the_heap(large),
                  "status": host_malloc.status}))
"""


def _buffers(env_switch: str | None) -> dict:
    env = {"VLLM_PORT_CPU_MALLOC": env_switch} if env_switch is not None else {}
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "VLLM_PORT_CPU_MALLOC"))
    }
    done = subprocess.run(
        [sys.executable, "-c", FROM_THE_HEAP], capture_output=True, text=True, env={**environ, **env}, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
@pytest.mark.slow
def test_bound_cpu_ops_make_malloc_serve_buffers_up_to_256_mib_from_the_heap():
    seen = _buffers(None)
    assert seen["status"].startswith("on (glibc mmap threshold "), seen
    mmap_threshold = int(seen["status"].split("mmap threshold ")[1].split(" MiB")[0]) << 20
    assert mmap_threshold in (host_malloc.MMAP_THRESHOLD, host_malloc.OLDER_GLIBC_MMAP_THRESHOLD), seen
    large = mmap_threshold == host_malloc.MMAP_THRESHOLD  # older glibc maps the 64 MiB one still
    assert seen == {"before": False, "after": True, "large": large, "status": seen["status"]}


@glibc
@pytest.mark.slow
def test_the_switch_off_leaves_malloc_as_it_was():
    seen = _buffers("0")
    assert seen == {"before": False, "after": False, "large": False, "status": "off: VLLM_PORT_CPU_MALLOC=0"}


def test_malloc_parameters_from_the_environment_are_the_users_choice(monkeypatch):
    for name in [host_malloc.ENV_SWITCH, "GLIBC_TUNABLES", *(n for n in os.environ if n.startswith("MALLOC_"))]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # not a threshold: no reason to stay away
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert host_malloc._apply() == "off: the environment sets MALLOC_TRIM_THRESHOLD_"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert host_malloc._apply() == "off: the environment sets GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536"


def test_a_switch_value_that_is_no_switch_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(host_malloc.ENV_SWITCH, "sometimes")
    with pytest.raises(SelectionError, match="VLLM_PORT_CPU_MALLOC='sometimes' is not a switch"):
        host_malloc._apply()
