"""Graph capture through the platform contract: a decode step captured once, replayed on new inputs.

Runs on a platform that offers graph capture (the H200 run of dev/gpu-run); skipped elsewhere.
"""

import pytest
import torch

import vllm_port


def test_captured_decode_step_replays_like_eager():
    runtime = vllm_port.load()
    capture = runtime.graph_capture()
    if capture is None:
        pytest.skip(f"platform {runtime.platform.name!r} has no graph capture")
    kernels, dev = runtime.bind(torch.bfloat16), runtime.device
    seqs, heads, kv_heads, head, block = 8, 32, 8, 128, 16
    x = torch.randn(seqs, heads * head, device=dev, dtype=torch.bfloat16)
    w = torch.randn(heads * head, device=dev, dtype=torch.bfloat16)
    cache = torch.randn(seqs * 8, block, kv_heads, head, device=dev, dtype=torch.bfloat16)
    tables = torch.arange(seqs * 8, device=dev, dtype=torch.int32).view(seqs, 8)
    lens = torch.full((seqs,), 100, device=dev, dtype=torch.int32)

    def step():
        q = kernels.rms_norm(x, w, 1e-6).view(seqs, heads, head)
        return kernels.paged_attention(q, cache, cache, tables, lens, head**-0.5)

    replay = capture.capture(step)
    x.copy_(torch.randn_like(x))  # new inputs, same addresses
    lens.fill_(77)
    torch.testing.assert_close(replay(), step())
