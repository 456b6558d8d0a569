"""Sweep the CUDA target's knobs for the row and element-wise Triton kernels against Inductor, on the GPU.

    python3 dev/tune_elementwise.py      (run by ``dev/gpu-run tune``)

Prints, per op and token count, each variant's device time (graph replays) next to the compiled
reference, so the CUDA target's defaults are chosen by measurement.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import vllm_port
from vllm_port.bench._timing import graph_median_ms
from vllm_port.bench.ops import workload
from vllm_port.kernels.triton.activation import ActivationKernels
from vllm_port.kernels.triton.norm import NormKernels
from vllm_port_cuda.triton_targets import CUDA

VARIANTS = [replace(CUDA, max_warps=w, elementwise_block=b) for w in (4, 8, 16) for b in (1024, 2048, 4096)]
OPS = {
    "rms_norm": NormKernels,
    "fused_add_rms_norm": NormKernels,
    "silu_and_mul": ActivationKernels,
    "gelu_and_mul": ActivationKernels,
}


def main() -> None:
    runtime = vllm_port.load(device="cuda")
    capture, dev = runtime.graph_capture(), runtime.device
    for op, cls in OPS.items():
        reference = torch.compile(runtime.registry.ops[op].reference, dynamic=False)
        for tokens in (256, 1024, 4096, 16384, 32768):
            args = workload(op, tokens, torch.bfloat16, dev).args
            base = graph_median_ms(lambda ref=reference, a=args: ref(*a), capture, dev) * 1e3
            times = {}
            for target in VARIANTS:
                fn = getattr(cls(target), op)
                times[(target.max_warps, target.elementwise_block)] = (
                    graph_median_ms(lambda fn=fn, a=args: fn(*a), capture, dev) * 1e3
                )
            best = min(times, key=times.get)
            cells = " ".join(f"w{w}/b{b}:{t:6.1f}" for (w, b), t in times.items())
            print(
                f"{op:<20}{tokens:>6} inductor {base:7.1f} us | best w{best[0]}/b{best[1]} {times[best]:7.1f} ({times[best] / base:5.2f}x) | {cells}",
                flush=True,
            )


if __name__ == "__main__":
    main()
