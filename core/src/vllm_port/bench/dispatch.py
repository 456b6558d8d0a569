"""Dispatch overhead on CPU: a bound op against calling its provider directly.

For scale it also times a pluggy hook call and a ``torch.library`` custom-op call of the same
kernel. Each case is timed with ``timeit`` (best of several repeats, per call), all in one run.
"""

from __future__ import annotations

import json
import platform
import timeit
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pluggy
import torch

import vllm_port
from vllm_port.ops import BoundOps

GOAL_NS = 500.0  # the bound call may add at most 0.5 us


def _per_call_ns(fn: Callable[[], Any], number: int, repeat: int = 7) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def _pluggy_caller(kernel: Callable[..., Any]) -> Callable[..., Any]:
    spec, impl = pluggy.HookspecMarker("bench"), pluggy.HookimplMarker("bench")

    class Spec:
        @spec(firstresult=True)
        def bench_rms_norm(self, x: Any, weight: Any, epsilon: Any) -> Any: ...

    class Impl:
        @impl
        def bench_rms_norm(self, x: Any, weight: Any, epsilon: Any) -> Any:
            return kernel(x, weight, epsilon)

    manager = pluggy.PluginManager("bench")
    manager.add_hookspecs(Spec)
    manager.register(Impl())
    return manager.hook.bench_rms_norm


def _custom_op(kernel: Callable[..., Any]) -> Callable[..., Any]:
    @torch.library.custom_op("vllm_port_bench::rms_norm", mutates_args=())
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
        return kernel(x, weight, epsilon)

    return rms_norm


def _ways_to_call(kernel: Callable[..., Any], kernels: BoundOps) -> dict[str, Callable[..., Any]]:
    hook = _pluggy_caller(kernel)
    return {
        "provider called directly": lambda x, w, eps: kernel(x, w, eps),
        "bound op (kernels.rms_norm)": lambda x, w, eps: kernels.rms_norm(x, w, eps),
        "pluggy hook call": lambda x, w, eps: hook(x=x, weight=w, epsilon=eps),
    }


def measure() -> dict[str, Any]:
    """Time each way of calling the bound ``rms_norm`` provider, and of an empty kernel, per call."""
    runtime = vllm_port.load(device="cpu")
    kernels = runtime.bind(torch.float32)
    chosen = kernels.providers["rms_norm"]
    x, w = torch.randn(1, 64), torch.ones(64)
    # The same binding mechanism around a kernel that does nothing isolates the dispatch cost.
    empty_kernels = BoundOps(kernels.context, {"rms_norm": replace(chosen, fn=lambda x, weight, epsilon: x)})
    empty = {
        name: _per_call_ns(lambda call=call: call(x, w, 1e-6), number=1_000_000)
        for name, call in _ways_to_call(empty_kernels.rms_norm, empty_kernels).items()
    }
    real = {
        name: _per_call_ns(lambda call=call: call(x, w, 1e-6), number=20_000)
        for name, call in _ways_to_call(chosen.fn, kernels).items()
    }
    custom = _custom_op(chosen.fn)
    real["torch.library custom op"] = _per_call_ns(lambda: custom(x, w, 1e-6), number=20_000)
    bound_overhead = empty["bound op (kernels.rms_norm)"] - empty["provider called directly"]
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "provider": chosen.name,
        "shape": [1, 64],
        "empty_kernel_ns_per_call": empty,
        "rms_norm_ns_per_call": real,
        "bound_overhead_ns": bound_overhead,
        "goal_ns": GOAL_NS,
        "goal_met": bound_overhead <= GOAL_NS,
    }


def main(json_path: str | None = None) -> int:
    """Print the tables (and write JSON); exit 0 when the bound call's overhead meets the goal."""
    result = measure()
    print(f"dispatch overhead on {result['machine']}, torch {result['torch']} (best of 7 repeats, per call)")
    for title, key in (("empty kernel: the cost of the call itself", "empty_kernel_ns_per_call"),
                       (f"rms_norm {result['shape']} float32 ({result['provider']})", "rms_norm_ns_per_call")):  # fmt: skip
        rows = result[key]
        base = rows["provider called directly"]
        print(f"\n{title}\n{'call':<32}{'ns/call':>10}{'added ns':>10}")
        for name, ns in rows.items():
            print(f"{name:<32}{ns:>10.0f}{ns - base:>10.0f}")
    verdict = "met" if result["goal_met"] else "MISSED"
    print(f"\nbound op adds {result['bound_overhead_ns']:.0f} ns; goal <= {GOAL_NS:.0f} ns: {verdict}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if result["goal_met"] else 1
