"""fp8_linear at 1 to 4,096 rows in captured graphs, beside cuBLASLt's ``torch._scaled_mm`` and bf16 cuBLAS.

``vllm-port bench fp8-linear`` times eager calls, so at M <= 256 it measured launch cost (``fp8-linear-h200.md``).
Here every path is one CUDA graph of calls over 8 copies of the weight (more bytes than the L2, as a decode
step's layers are), replayed; per call. Rows: Llama-3-8B's and Qwen3-30B-A3B's projections (the bench's
``SHAPES``), bf16 activations, e4m3 weights with per-channel scales. Columns:

- ``fp8_linear``: the CUDA target's bound Triton provider as the engine runs it (one row: the one-row kernel;
  more: per-token quantisation, then the FP8 dot), checked against the op's oracle first;
- ``scaled_mm``: ``torch._scaled_mm`` on activations already in e4m3 with one scale per row (rowwise, as
  per-token quantisation makes them): cuBLASLt's matmul alone;
- ``scaled_mm+quant``: the same behind torch's per-token quantisation (amax, divide, convert), captured too;
- ``bf16``: ``torch.nn.functional.linear`` on the bf16 weight (cuBLAS).

Usage on the GPU: ``python3 dev/experiments/probe_fp8_rows.py [OUT.json]``. The numbers in ``fp8-linear-h200.md`` came
from it at 85005ad, whose own copy of ``graph_us`` replayed 10 times after one warm-up replay (now 20 after 3).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from probe_fp8_one_row import graph_us  # this folder's other probe: one CUDA graph of calls, replayed

from vllm_port.bench._timing import copy_bandwidth_gbs
from vllm_port.bench.fp8_linear import SHAPES
from vllm_port.kernels.triton.fp8_linear import Fp8LinearKernels
from vllm_port.ops import fp8_linear
from vllm_port.ops.fp8 import quantize_fp8_rows, quantize_fp8_weight
from vllm_port_cuda.triton_targets import CUDA

ROWS = (1, 2, 4, 8, 16, 64, 256, 4096)
COPIES = 8


def main() -> None:
    device = torch.device("cuda")
    copy = copy_bandwidth_gbs(device, 1 << 30)
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; copy bandwidth {copy:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    kernels = Fp8LinearKernels(CUDA)
    rows = []
    for name, (k, n) in SHAPES.items():
        dense = [(torch.randn(n, k, generator=gen) / k**0.5).to(device, torch.bfloat16) for _ in range(COPIES)]
        quantised = [tuple(t.to(device) for t in quantize_fp8_weight(w.float(), "channel")) for w in dense]
        for m in ROWS:
            x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
            fp8 = [(x, q, s, None) for q, s in quantised]
            row = {"shape": name, "m": m, "k": k, "n": n, "copy_gbs": copy}
            problem = fp8_linear.check(kernels.fp8_linear, fp8[0], torch.bfloat16)
            row["fp8_linear ok"] = problem is None
            row["fp8_linear us"] = graph_us(kernels.fp8_linear, fp8)
            xq, xs = quantize_fp8_rows(x)
            scaled = [(q, s.view(1, -1)) for q, s in quantised]
            try:
                row["scaled_mm us"] = graph_us(
                    lambda w, s, a=xq, a_s=xs: torch._scaled_mm(
                        a, w.t(), scale_a=a_s, scale_b=s, out_dtype=torch.bfloat16
                    ),
                    scaled,
                )

                def quantise_then_mm(w: torch.Tensor, s: torch.Tensor, x: torch.Tensor = x) -> torch.Tensor:
                    a, a_scale = quantize_fp8_rows(x)
                    return torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=s, out_dtype=torch.bfloat16)

                row["scaled_mm+quant us"] = graph_us(quantise_then_mm, scaled)
            except RuntimeError as exc:  # a layout this cuBLASLt refuses: said, not fatal
                row["scaled_mm error"] = str(exc).splitlines()[0]
            row["bf16 us"] = graph_us(lambda w, x=x: F.linear(x, w), [(w,) for w in dense])
            for key in [key for key in row if key.endswith(" us")]:
                weight_bytes = n * k * (2 if key.startswith("bf16") else 1)
                row[key.replace(" us", " of copy")] = round(weight_bytes / (row[key] * 1e-6) / 1e9 / copy, 3)
                row[key.replace(" us", " TFLOP/s")] = round(2 * m * n * k / (row[key] * 1e-6) / 1e12, 1)
            if "scaled_mm us" in row:
                row["fp8_linear / scaled_mm speed"] = round(row["scaled_mm us"] / row["fp8_linear us"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del dense, quantised
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
