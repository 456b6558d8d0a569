"""The CUDA plugin picks the Triton target whose attention tiles fit the GPUs present.

The Hopper target's TMA loads need sm_90, and its prefill is tuned for two programs of 96 KiB of
shared memory on one multiprocessor: it must never be launched on an A100 (no TMA) or an RTX 5090
(99 KiB). The budget is computed from the kernels' own tile
choice (``_tiles``), so a retuned target that outgrows its parts fails here, not on a user's GPU.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from vllm_port.kernels.triton.attention import _tiles
from vllm_port_cuda import ops
from vllm_port_cuda.platform import NvmlDevice
from vllm_port_cuda.triton_targets import CUDA, CUDA_AMPERE, CUDA_COMPACT

HEAD, BF16 = 128, 2


def _shared_kib(target, decode: bool) -> float:
    """Shared memory of one attention program (bf16, head 128): the query tile and ``stages`` K and V tiles."""
    block_m, block_n, stages = _tiles(target, HEAD, BF16, decode=decode)
    rows = 16 if decode else block_m  # decode's query tile is the group of heads, padded to 16
    return (rows * HEAD * BF16 + stages * 2 * block_n * HEAD * BF16) / 1024


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ([(9, 0)], CUDA),  # H100, H200
        ([(10, 0)], CUDA),  # B200
        ([(8, 0)], CUDA_AMPERE),  # A100
        ([(8, 9)], CUDA_COMPACT),  # L40S
        ([(12, 0)], CUDA_COMPACT),  # RTX 5090: Blackwell, but a consumer part's shared memory
        ([(9, 0), (8, 0)], CUDA_AMPERE),  # mixed: what fits every device
        ([], CUDA),  # no GPU seen (the interpreter)
    ],
)
def test_target_by_compute_capability(gpus, expected) -> None:
    assert ops.target_for(gpus) == expected


def test_turing_gets_a_single_stage() -> None:
    target = ops.target_for([(7, 5)])
    assert (target.attn_block_m, target.attn_stages) == (64, 1)


def test_an_unlisted_part_assumes_the_least_memory_of_its_generation() -> None:
    assert ops.shared_memory_kib((8, 8)) == 99
    assert ops.shared_memory_kib((13, 0)) == 64
    assert ops.target_for([(13, 0)]).attn_stages == 1


@pytest.mark.parametrize("capability", sorted(ops.SHARED_MEMORY_KIB))
def test_the_chosen_tiles_fit_the_part(capability) -> None:
    target = ops.target_for([capability])
    budget = ops.shared_memory_kib(capability)
    for decode in (False, True):
        assert _shared_kib(target, decode) <= budget, (capability, target.name, decode)
    assert (target.prefill_tma or target.decode_tma) <= (capability >= (9, 0))


def test_two_hopper_prefill_programs_share_a_multiprocessor() -> None:
    """The Hopper tiles were measured fastest with two programs a multiprocessor (228 KiB on sm_90)."""
    assert 2 * _shared_kib(CUDA, decode=False) <= ops._HOPPER_NEEDS_KIB <= ops.SHARED_MEMORY_KIB[(9, 0)]


def test_providers_use_the_target_of_the_visible_gpus(monkeypatch) -> None:
    monkeypatch.setattr(ops, "visible_capabilities", lambda: [(8, 0)])
    attention = next(p for p in ops.providers() if p.op == "prefill_attention")
    assert attention.fn.__self__.target == CUDA_AMPERE


def test_the_visible_gpus_capabilities_come_from_nvml_in_cuda_visible_devices_order(monkeypatch) -> None:
    asked = []

    def read_nvml(visible):
        asked.append(visible)
        return [NvmlDevice("NVIDIA A100", 80 << 30, (8, 0)), NvmlDevice("NVIDIA H200", 141 << 30, (9, 0))], "570.1"

    monkeypatch.setattr(ops.platform, "read_nvml", read_nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert ops.visible_capabilities() == [(8, 0), (9, 0)] and asked == [["1", "0"]]
    assert ops.target_for(ops.visible_capabilities()) == CUDA_AMPERE  # what fits both


def test_without_nvml_or_a_cuda_gpu_no_capability_is_known(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(ops.platform, "read_nvml", lambda visible: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ops.visible_capabilities() == []
