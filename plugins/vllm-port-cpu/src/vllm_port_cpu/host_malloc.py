"""glibc's malloc told to keep freed buffers, in a process that runs the CPU plugin's kernels.

Every provider returns fresh tensors. With glibc's default thresholds a process hands freed memory
back to the kernel (``munmap`` of a buffer above the mmap threshold, 128 KiB at start; the top of a
heap shrunk past the trim threshold), and the next buffers' pages fault in again one at a time at
first write, each zeroed by the kernel. A greedy ``generate`` of 64 requests x 128 tokens on the
engine benchmark's model (hidden 512) faulted in about 210,000 pages in this project's engine in bfloat16
(440,000 in float32), and the bridge's calls raised vLLM 0.32's count for the same run in float32 from
about 25,000 to 190,000 (vLLM alone writes most activations into buffers its compiled graph reuses):
``docs/results/bridge-cpu.md``.

:func:`keep_freed_buffers` raises both thresholds once per process (256 MiB for ``mmap``; 256 MiB of freed
heap kept), as tcmalloc keeps what it frees: a freed buffer serves the next one of its size. That takes in
a prefill's activations too: a ``silu_and_mul`` of 8,192 tokens by 2,048 in float32 writes 64 MiB, which
at a 32 MiB threshold faulted in 16,384 fresh pages a call, about 25 ms a call for 7 ms of work
(``docs/results/bridge-cpu.md``). Older glibc refuses an mmap threshold above 32 MiB on 64 bits (half its
heap size): there the threshold is 32 MiB, and larger buffers still come and go through ``mmap``. glibc
2.36 takes 256 MiB. The process may keep up to the trim threshold of freed memory per heap that it would
otherwise give back.

Left alone: a libc that is not glibc, thresholds given in the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``, ``MALLOC_MMAP_MAX_`` or their ``GLIBC_TUNABLES``: the user's
choice), and ``VLLM_PORT_CPU_MALLOC=0``. A malloc preloaded in glibc's place (tcmalloc, jemalloc) ignores them.
"""

from __future__ import annotations

import ctypes
import os
import platform
import threading

from vllm_port.faults import read_switch

__all__ = [
    "ENV_SWITCH",
    "MMAP_THRESHOLD",
    "OLDER_GLIBC_MMAP_THRESHOLD",
    "TRIM_THRESHOLD",
    "keep_freed_buffers",
    "status",
]

#: ``0`` leaves glibc's malloc parameters as they are
ENV_SWITCH = "VLLM_PORT_CPU_MALLOC"
#: buffers up to this size come from the heap and are reused once freed
MMAP_THRESHOLD = 256 << 20
#: the largest mmap threshold older glibc accepts on 64 bits: the threshold where it refuses MMAP_THRESHOLD
OLDER_GLIBC_MMAP_THRESHOLD = 32 << 20
#: freed memory a heap keeps at its top before handing it back to the kernel
TRIM_THRESHOLD = 256 << 20
#: glibc's environment settings of the same parameters: where one is set, the user has chosen
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
# mallopt's parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: what :func:`keep_freed_buffers` did in this process: ``"not yet"``, ``"on (...)"`` or ``"off: <why>"``
status = "not yet"
_lock = threading.Lock()


def keep_freed_buffers() -> str:
    """Raise glibc's mmap and trim thresholds for this process, once; returns :data:`status`."""
    global status
    with _lock:
        if status == "not yet":
            status = _apply()
    return status


def _apply() -> str:
    if not read_switch(ENV_SWITCH, default=True):
        return f"off: {ENV_SWITCH}=0"
    given = [name for name in _USER_SETTINGS if name in os.environ]
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if any(f"glibc.malloc.{name}" in tunables for name in ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")):
        given.append(f"GLIBC_TUNABLES={tunables}")
    if given:
        return f"off: the environment sets {', '.join(given)}"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"off: not glibc ({platform.system()} {platform.libc_ver()[0] or 'libc'})"
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return "off: this libc has no mallopt"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mmap_threshold = next((t for t in (MMAP_THRESHOLD, OLDER_GLIBC_MMAP_THRESHOLD) if mallopt(_M_MMAP_THRESHOLD, t)), 0)
    if not (mmap_threshold and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return "off: glibc refused the thresholds"
    return f"on (glibc mmap threshold {mmap_threshold >> 20} MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB)"
