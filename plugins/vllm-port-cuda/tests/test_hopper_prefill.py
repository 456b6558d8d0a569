"""The Hopper prefill (``vllm_port_cuda.hopper_prefill``): where the plugin binds it, what it serves, and, on an
sm_90 GPU, its outputs against the op's float64 reference.

Gluon kernels do not run in Triton's interpreter, so on a machine without a GPU these tests check the binding
(sm_90 only), the scope rules and the fallback to the Triton kernel; ``core/tests/triton/test_hopper_compile.py``
checks offline that the kernel compiles for sm_90 to FlashAttention-3's schedule. The GPU tests run with
``dev/gpu-run check`` and, through every prefill sample of the op, in ``vllm-port certify cuda``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from vllm_port.errors import OpInputError
from vllm_port.ops import Provider
from vllm_port.ops import prefill_attention as op
from vllm_port.ops.attention import _paged_batch, _queries
from vllm_port_cuda import hopper_prefill, ops

HEADS, KV_HEADS, HEAD = 8, 2, 128


def _inputs(q_lens, prefixes, *, device="cpu", dtype=torch.bfloat16, block_size=128, heads=HEADS, kv_heads=KV_HEADS,
            interleaved=False, fused=False, head=HEAD, seed=0):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    lens = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
    kc, vc, tables, seq_lens = _paged_batch(gen, device, dtype, lens, kv_heads, head, block_size, interleaved)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = _queries(gen, device, dtype, sum(q_lens), heads, kv_heads, head, 1.0, fused)
    return (q, kc, vc, tables, cu, seq_lens, max(q_lens), head**-0.5)


def _triton_stub(calls: list) -> Provider:
    def prefill_attention(*args):
        calls.append(args)
        return torch.zeros_like(args[0])

    return Provider("prefill_attention", "triton_prefill_attention", prefill_attention, ops.TRITON_PRIORITY)


@pytest.mark.parametrize(
    ("gpus", "bound"),
    [
        ([(9, 0)], True),
        ([(9, 0), (9, 0)], True),
        ([(10, 0)], False),
        ([(8, 0)], False),
        ([(9, 0), (8, 0)], False),
        ([], False),
    ],
)
def test_bound_on_hopper_only(gpus, bound):
    """``wgmma`` is sm_90's alone: Blackwell, Ampere and a mixed machine keep the Triton kernel."""
    found = ops.hopper_providers(gpus, [_triton_stub([])])
    assert bool(found) == bound
    if bound:
        (provider,) = found
        assert provider.op == "prefill_attention" and provider.priority > ops.TRITON_PRIORITY
        assert provider.dtypes == {torch.bfloat16, torch.float16}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"interleaved": True}, None),  # K and V of one buffer: any block stride
        ({"fused": True}, None),  # the query a slice of a fused QKV
        ({"block_size": 256}, None),
        ({"dtype": torch.float16}, None),
        ({"dtype": torch.float32}, "bf16 or fp16"),
        ({"block_size": 16}, None),  # a TMA box a block, eight a key tile
        ({"block_size": 64}, None),
        ({"block_size": 8}, "16, 32, 64 or a multiple of 128"),
        ({"block_size": 48}, "16, 32, 64 or a multiple of 128"),
        ({"head": 64}, "head 128"),
    ],
)
def test_scope(change, reason):
    q, kc, vc, *_ = _inputs([5], [3], **change)
    why = hopper_prefill.unsupported(q, kc, vc)
    assert (why is None) if reason is None else (reason in why), why


def test_scope_window_soft_cap_and_strides():
    q, kc, vc, *_ = _inputs([5], [3])
    assert "window" in hopper_prefill.unsupported(q, kc, vc, sliding_window=8)
    assert "soft cap" in hopper_prefill.unsupported(q, kc, vc, soft_cap=30.0)
    assert "key_cache" in hopper_prefill.unsupported(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc)
    assert "query" in hopper_prefill.unsupported(q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc)


def test_outside_the_gpu_or_its_scope_the_triton_kernel_runs():
    calls: list = []
    (provider,) = ops.hopper_providers([(9, 0)], [_triton_stub(calls)])
    args = _inputs([5, 3], [3, 0])
    provider.fn(*args)  # CPU tensors
    provider.fn(*_inputs([5], [3], block_size=8))
    assert len(calls) == 2 and calls[0][:8] == args and calls[0][8:] == (0, 0.0)


def test_bad_input_is_refused_before_anything_runs():
    calls: list = []
    (provider,) = ops.hopper_providers([(9, 0)], [_triton_stub(calls)])
    q, kc, vc, tables, cu, lens, max_q, scale = _inputs([5], [3])
    with pytest.raises(OpInputError, match="prefill_attention"):
        provider.fn(q[:, :3], kc, vc, tables, cu, lens, max_q, scale)  # 3 query heads over 2 KV heads
    assert not calls


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = {
    "one sequence of 1000": dict(q_lens=[1000], prefixes=[0]),
    "ragged, with prefixes": dict(q_lens=[200, 77, 1, 300], prefixes=[77, 300, 500, 0]),
    "a padded sequence among others": dict(q_lens=[130, 5], prefixes=[0, 0], padded=1),
    "gqa 1, fp16": dict(q_lens=[300], prefixes=[40], heads=4, kv_heads=4, dtype=torch.float16),
    "gqa 8, 256-token blocks": dict(q_lens=[129, 400], prefixes=[255, 0], heads=16, kv_heads=2, block_size=256),
    "interleaved caches, fused query": dict(q_lens=[257, 31], prefixes=[0, 99], interleaved=True, fused=True),
    "int64 metadata": dict(q_lens=[150, 60], prefixes=[10, 128], int64=True),
    "16-token blocks, ragged, prefixes": dict(q_lens=[200, 77, 1, 300], prefixes=[77, 300, 500, 0], block_size=16),
    "32-token blocks, gqa 8": dict(q_lens=[129, 400], prefixes=[255, 0], heads=16, kv_heads=2, block_size=32),
    "64-token blocks, fused query, interleaved caches": dict(
        q_lens=[257, 31], prefixes=[0, 99], block_size=64, interleaved=True, fused=True
    ),
    "512-token blocks, fp16": dict(q_lens=[700, 3], prefixes=[383, 0], block_size=512, dtype=torch.float16),
    "2048 after a 1024 prefix": dict(q_lens=[2048], prefixes=[1024]),
}


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (the Gluon kernel has no interpreter)")
@pytest.mark.parametrize("pingpong", [True, False])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_matches_the_reference_on_hopper(case, pingpong):
    """The op's own check: the float64 reference, NaN in every slot no sequence owns."""
    spec = dict(GPU_CASES[case])
    padded, int64 = spec.pop("padded", None), spec.pop("int64", False)
    args = list(_inputs(device="cuda", **spec))
    if padded is not None:  # a padded sequence keeps its query rows but has no cached token: zeros
        args[5] = args[5].clone()
        args[5][padded] = 0
    if int64:
        args[3:6] = [t.to(torch.int64) for t in args[3:6]]
    assert hopper_prefill.unsupported(*args[:3]) is None

    def run(*a):
        return hopper_prefill.hopper_prefill_attention(*a[:8], pingpong=pingpong)

    problem = op.check(run, (*args, 0, 0.0), args[0].dtype)
    assert problem is None, f"{case}: {problem}"
