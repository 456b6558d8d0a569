"""The Triton ``fused_moe`` kernels against the op's contract, and the sort of (token, expert) pairs they read.

Without a GPU they run in Triton's CPU interpreter (the root conftest.py sets TRITON_INTERPRET=1) at
the interpreter target's tiles, which make the small samples cross tile edges and take both the
decode tiles (up to 8 tokens) and the prefill ones; the real models' layers are device samples only.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton import INTERPRETER  # noqa: E402
from vllm_port.kernels.triton.moe import MoeKernels, sort_pairs_by_expert  # noqa: E402
from vllm_port.ops import ALL_OPS, OpRegistry, Provider, fused_moe  # noqa: E402
from vllm_port.ops.checks import validation  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402
from vllm_port_rocm.triton_targets import ROCM  # noqa: E402
from vllm_port_xpu.triton_targets import XPU  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
KERNELS = MoeKernels(CUDA if DEVICE.type == "cuda" else INTERPRETER)
#: the samples a fast run takes: the variants' base (shared experts, renormalised), decode, tied logits
FAST = ("small", "one token (decode)", "tied router logits: the lower expert index wins")


def _samples(dtype: torch.dtype, labels: tuple[str, ...] | None = None):
    found = fused_moe.samples(dtype, DEVICE, torch.Generator().manual_seed(0))
    return [s for s in found if not (INTERPRETED and s.large) and (labels is None or s.label in labels)]


def _problems(fn, samples, dtype) -> list[str]:
    with validation():
        return [f"{s.label}: {p}" for s in samples if (p := fused_moe.check(fn, s.args, dtype))]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_honours_the_contract_on_a_few_samples(dtype):
    assert not _problems(KERNELS.fused_moe, _samples(dtype, FAST), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_honours_the_contract_on_every_sample(dtype):
    samples = _samples(dtype)
    assert any(s.args[2].shape[0] == 128 for s in samples)  # Qwen3-30B-A3B's routing
    assert not _problems(KERNELS.fused_moe, samples, dtype)


@pytest.mark.slow
def test_the_cuda_targets_tiles_honour_the_contract():
    """The CUDA plugin's tiles (64-128 wide: every small sample inside one tile) in the interpreter or on the GPU."""
    fn = MoeKernels(CUDA).fused_moe
    assert not _problems(
        fn,
        _samples(torch.bfloat16, (*FAST, "mixtral routing (8 experts, top-2, renormalised), small widths")),
        torch.bfloat16,
    )


def test_signature_equals_the_reference_and_registers():
    OpRegistry(ALL_OPS).register(
        Provider("fused_moe", "triton_fused_moe", KERNELS.fused_moe, 20), plugin="t", platform="gpu"
    )


@pytest.mark.parametrize("target", [INTERPRETER, CUDA, ROCM, XPU], ids=lambda t: t.name)
def test_the_small_sample_with_every_target(target):
    assert not _problems(MoeKernels(target).fused_moe, _samples(torch.bfloat16, ("small",)), torch.bfloat16)


def test_kernel_refuses_what_the_reference_refuses():
    for case in fused_moe.errors(DEVICE):
        with pytest.raises(OpInputError, match=case.match.replace("[", r"\[")):
            KERNELS.fused_moe(*case.args)
    for case in fused_moe.value_errors(DEVICE):
        with validation(), pytest.raises(OpInputError, match=case.match.replace("[", r"\[")):
            KERNELS.fused_moe(*case.args)


def test_pairs_are_sorted_by_expert_and_padded_per_block():
    ids = torch.tensor([[3, 0], [0, 3], [3, 1], [0, 2], [3, 0]], device=DEVICE)
    pairs, block_expert, total = sort_pairs_by_expert(ids, num_experts=5, block_m=4)
    flat = ids.flatten()
    used = int(total)
    assert used == 4 * 4  # experts 0 (4 pairs), 1, 2 (1 each), 3 (4): four blocks of 4, expert 4 idle
    assert pairs.shape[0] >= used and pairs.shape[0] % 4 == 0
    real = pairs[:used][pairs[:used] < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair once
    for block in range(used // 4):
        rows = pairs[4 * block : 4 * block + 4]
        experts = {int(flat[p]) for p in rows if p < flat.numel()}
        assert experts == {int(block_expert[block])}  # one expert a block
    assert (pairs[used:] == flat.numel()).all()  # what follows is padding


@pytest.mark.parametrize("block_m", [16, 64])
def test_the_one_program_sort_of_a_decode_step_equals_the_torch_one(monkeypatch, block_m):
    """Ids as ``route`` returns them: the first columns of a sort's indices (strided; top-1 flattens to a view)."""
    from vllm_port.kernels.triton import moe

    gen = torch.Generator().manual_seed(block_m)
    for experts, tokens, top_k in [(1, 5, 1), (16, 11, 1), (8, 1, 2), (128, 16, 8), (64, 3, 6), (200, 9, 4)]:
        ids = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).to(DEVICE)[:, :top_k]
        one = moe.sort_pairs_by_expert(ids, experts, block_m)
        monkeypatch.setattr(moe, "_ALIGN_SMALL_PAIRS", 0)  # the torch ops
        many = moe.sort_pairs_by_expert(ids, experts, block_m)
        monkeypatch.undo()
        used = int(many[2])
        assert int(one[2]) == used and torch.equal(one[0], many[0])
        assert torch.equal(one[1][: used // block_m], many[1][: used // block_m])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on the infinities and NaN below
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_the_one_program_routing_of_a_decode_step_equals_route_and_the_sort(scoring):
    """The same experts as ``route`` on the host (ties to the lower index, ``-0.0`` equal to ``0.0``, NaN and
    infinities where the stable sort puts them), its weights to float32 rounding, and the same sorted pairs.

    The reference runs on the CPU: torch's CUDA sort puts a NaN logit last, where its CPU sort (and the contract's
    rule) puts it first; measured on an H100 (torch 2.11), the kernel agreeing with the CPU."""
    from vllm_port.kernels.triton.moe import route_and_sort
    from vllm_port.ops.moe import route

    gen = torch.Generator().manual_seed(1)
    cases = [(1, 128, 8), (16, 128, 8), (3, 8, 2), (5, 64, 6), (1, 1, 1), (7, 200, 4), (64, 8, 2), (2, 16, 16)]
    for (tokens, experts, top_k), dtype, renormalize in zip(
        cases, [torch.float32, torch.bfloat16, torch.float16] * 3, [True, False] * 4, strict=False
    ):
        logits = torch.randn(tokens, experts, generator=gen)
        if experts >= 8:  # a row of three values (ties at the top-k edge), a signed zero beside a zero
            logits[-1] = torch.arange(experts).remainder(3).float()
            logits[-1, :2] = torch.tensor([-0.0, 0.0])
        if tokens >= 3:  # a NaN, a +inf, a row of -inf but one
            logits[0, 5], logits[1, 3], logits[2] = float("nan"), float("inf"), float("-inf")
            logits[2, 1] = -1e30
        logits = logits.to(dtype)
        want_w, want_ids = (t.to(DEVICE) for t in route(logits, top_k, scoring, renormalize, 2.5))
        weights, ids, (pairs, block_expert, total) = route_and_sort(
            logits.to(DEVICE), top_k, scoring, renormalize, 2.5, 16
        )
        label = f"{tokens} x {experts}, top-{top_k}, {dtype}"
        assert torch.equal(ids, want_ids), label
        torch.testing.assert_close(weights, want_w.float(), rtol=2e-6, atol=1e-7, equal_nan=True, msg=label)
        want_pairs, want_blocks, want_total = sort_pairs_by_expert(want_ids, experts, 16)
        used = int(want_total)
        assert int(total) == used and torch.equal(pairs, want_pairs), label
        assert torch.equal(block_expert[: used // 16], want_blocks[: used // 16]), label


def test_routing_outside_one_program_takes_the_torch_ops(monkeypatch):
    """Float64 logits, more pairs than one program sorts, or the target's switch off: ``route``'s ops, then the sort."""
    from vllm_port.kernels.triton import moe

    calls, route = [], moe.route
    monkeypatch.setattr(moe, "route", lambda *args: calls.append(tuple(args[0].shape)) or route(*args))
    logits = torch.randn(4, 8, device=DEVICE)
    moe.route_and_sort(logits.double(), 2, "softmax", True, 1.0, 16)
    moe.route_and_sort(torch.randn(65, 8, device=DEVICE), 2, "softmax", True, 1.0, 16)  # 130 pairs
    moe.route_and_sort(logits, 2, "softmax", True, 1.0, 16, one_program=False)
    moe.route_and_sort(logits, 2, "softmax", True, 1.0, 16)  # the one program
    assert calls == [(4, 8), (65, 8), (4, 8)]
