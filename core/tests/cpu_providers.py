"""The CPU plugin's provider that binds for an op here: its native kernel where it has one and the library builds.

The CPU plugin ranks its native C kernels (``vllm_port_cpu.native``: attention, norms, rotary, the
SiLU product) above its torch providers; without a C compiler, or with ``VLLM_PORT_CPU_NATIVE=0``,
the torch ones serve. Tests that name the provider a binding picks (or the next candidate after a
faulty one) ask :func:`cpu_provider` instead of spelling either name.
"""

from __future__ import annotations

from vllm_port_cpu import native

#: the ops the CPU plugin has native kernels for (``vllm_port_cpu.native`` and ``native_elementwise``)
NATIVE_OPS = frozenset(
    {"rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "paged_attention", "prefill_attention"}
)


def cpu_provider(op: str) -> str:
    """The name of the CPU plugin's highest-ranked provider of ``op`` that serves on this machine."""
    return f"cpu_native_{op}" if op in NATIVE_OPS and native.library() is not None else f"cpu_{op}"
