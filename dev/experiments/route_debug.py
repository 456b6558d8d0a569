"""Where the one-program routing and route() disagree on the GPU (the test's case 16 x 128, top-8, bf16)."""

import torch

from vllm_port.kernels.triton.moe import route_and_sort
from vllm_port.ops.moe import route

dev = torch.device("cuda")
gen = torch.Generator().manual_seed(1)
cases = [(1, 128, 8), (16, 128, 8), (3, 8, 2), (5, 64, 6), (1, 1, 1), (7, 200, 4), (64, 8, 2), (2, 16, 16)]
for scoring in ("softmax",):
    gen = torch.Generator().manual_seed(1)
    for (tokens, experts, top_k), dtype, renorm in zip(
        cases, [torch.float32, torch.bfloat16, torch.float16] * 3, [True, False] * 4, strict=False
    ):
        logits = torch.randn(tokens, experts, generator=gen)
        if experts >= 8:
            logits[-1] = torch.arange(experts).remainder(3).float()
            logits[-1, :2] = torch.tensor([-0.0, 0.0])
        if tokens >= 3:
            logits[0, 5], logits[1, 3], logits[2] = float("nan"), float("inf"), float("-inf")
            logits[2, 1] = -1e30
        lg = logits.to(dtype)
        _, cpu_ids = route(lg, top_k, scoring, renorm, 2.5)
        _, gpu_ids = route(lg.to(dev), top_k, scoring, renorm, 2.5)
        _, k_ids, _ = route_and_sort(lg.to(dev), top_k, scoring, renorm, 2.5, 16)
        k_ids, gpu_ids = k_ids.cpu(), gpu_ids.cpu()
        print(
            (tokens, experts, top_k, dtype),
            "kernel==cpu route",
            torch.equal(k_ids, cpu_ids),
            "gpu route==cpu route",
            torch.equal(gpu_ids, cpu_ids),
        )
        for t in range(tokens):
            if not torch.equal(k_ids[t], cpu_ids[t]) or not torch.equal(gpu_ids[t], cpu_ids[t]):
                print(
                    "  row",
                    t,
                    "cpu",
                    cpu_ids[t].tolist(),
                    "gpu route",
                    gpu_ids[t].tolist(),
                    "kernel",
                    k_ids[t].tolist(),
                )
                print("    values at cpu ids", lg[t, cpu_ids[t]].tolist(), "at kernel ids", lg[t, k_ids[t]].tolist())
