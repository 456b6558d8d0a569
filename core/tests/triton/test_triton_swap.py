"""The swap kernel and the migrator that uses it, against torch indexing, bit for bit.

Without a GPU the kernel runs in Triton's CPU interpreter on host tensors (the migrator reaches it
with ``host_copies=True``); on a GPU the same tests swap between device memory and pinned host
memory through the mapping, the path the CUDA plugin's migrator takes.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch

from vllm_port.bench import swap as bench_swap
from vllm_port.errors import MemoryContractError, StrictModeError
from vllm_port.kernels.swap_migrator import FusedSwapMigrator
from vllm_port.kernels.triton import swap
from vllm_port.kernels.triton.swap import plan_block_copy, swap_blocks
from vllm_port.memory import (
    HostMemoryAllocator,
    KVCache,
    KVLayout,
    TorchDeviceAllocator,
    TorchMigrator,
)

ACCELERATOR = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
#: where the "device" cache lives: the accelerator, or the host under the interpreter
DEVICE = torch.device(ACCELERATOR.type, 0) if ACCELERATOR is not None else torch.device("cpu")
ON_GPU = DEVICE.type != "cpu"
#: a KV layout of 2 layers, 4 tokens a block, 2 heads of 8: 512 bytes a block in bfloat16
LAYERS, BLOCK, HEADS, HEAD = 2, 4, 2, 8


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (NaN payloads included: the copy must move bits, not values)."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)


def _device_blocks(
    num_blocks: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16, head: int = HEAD, tokens: int = BLOCK
) -> torch.Tensor:
    """A layer-major device cache's ``blocks`` view, as ``KVCache`` makes it: 2 x layers pieces a block."""
    caches = _random((2, LAYERS, num_blocks, tokens, HEADS, head), dtype, seed).to(DEVICE)
    return caches.permute(2, 0, 1, 3, 4, 5)


def _host_blocks(
    num_blocks: int,
    seed: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    head: int = HEAD,
    tokens: int = BLOCK,
    offset: int = 0,
) -> torch.Tensor:
    """A block-major host cache (the pinned_host tier's layout) starting ``offset`` elements into its
    buffer, pinned when there is a device to map it."""
    shape = (num_blocks, 2, LAYERS, tokens, HEADS, head)
    numel = torch.Size(shape).numel() + offset
    flat = torch.zeros(numel, dtype=dtype) if seed is None else _random((numel,), dtype, seed)
    return (flat.pin_memory() if ON_GPU else flat)[offset:].view(shape)


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    t = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    return t.pin_memory() if ON_GPU else t


def _expected(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """``dst`` after the copy, by torch indexing on the host."""
    out = dst.cpu().clone()
    if pairs:
        src_ids, dst_ids = zip(*pairs, strict=True)
        out[list(dst_ids)] = src.cpu()[list(src_ids)]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def _sync() -> None:
    if ON_GPU:
        torch.accelerator.synchronize()


RNG = random.Random(17)
#: per case, the (src block, dst block) pairs of a swap-out (7 device blocks -> 9 host blocks) and a swap-in
PAIR_CASES = {
    "one block": ([(5, 2)], [(8, 6)]),
    "many, unsorted, a source twice": (
        [(6, 0), (1, 8), (6, 3), (0, 1), (4, 7), (2, 2), (5, 6)],
        [(3, 6), (8, 0), (3, 2), (0, 5), (7, 1)],
    ),
    "random": (
        list(zip(RNG.choices(range(7), k=9), RNG.sample(range(9), 9), strict=True)),
        list(zip(RNG.choices(range(9), k=7), RNG.sample(range(7), 7), strict=True)),
    ),
    "none": ([], []),
}


@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize("case", PAIR_CASES)
def test_swap_blocks_equals_torch_indexing(direction: str, case: str) -> None:
    device, host = _device_blocks(7, seed=1), _host_blocks(9, seed=2)
    out_pairs, in_pairs = PAIR_CASES[case]
    src, dst, pairs = (device, host, out_pairs) if direction == "out" else (host, device, in_pairs)
    expected = _expected(src, dst, pairs)
    swap_blocks(src, dst, _pairs(pairs))
    _sync()
    assert _same_bits(dst, expected)


@pytest.mark.parametrize(
    ("dtype", "tokens", "head", "offset", "word_bytes"),
    [
        (torch.bfloat16, BLOCK, HEAD, 0, 8),
        (torch.bfloat16, 1, 3, 0, 4),  # 12-byte pieces
        (torch.float32, BLOCK, HEAD, 1, 4),  # the host cache starts 4 bytes into its buffer
        (torch.bfloat16, BLOCK, HEAD, 1, 2),
        (torch.uint8, 1, 3, 1, 1),
    ],
)
def test_the_widest_word_the_layout_allows(
    dtype: torch.dtype, tokens: int, head: int, offset: int, word_bytes: int
) -> None:
    device = _device_blocks(5, seed=3, dtype=dtype, head=head, tokens=tokens)
    host = _host_blocks(4, dtype=dtype, head=head, tokens=tokens, offset=offset)
    plan = plan_block_copy(device, host)
    assert plan.word_bytes == word_bytes and plan.pieces == 2 * LAYERS  # one piece a layer's keys or values
    assert plan.block_bytes == host[0].numel() * host.element_size()
    for src, dst, pairs in ((device, host, [(4, 0), (0, 3), (2, 1)]), (host, device, [(3, 3), (0, 1)])):
        expected = _expected(src, dst, pairs)
        swap_blocks(src, dst, _pairs(pairs))
        _sync()
        assert _same_bits(dst, expected)


def test_a_contiguous_block_is_one_piece_split_over_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swap, "_CHUNK_WORDS", 4)  # a program copies 4 words: a 6-word block takes 2, the last masked
    src = _host_blocks(3, seed=4, tokens=1, head=3).view(3, -1)  # 24 bfloat16 = 6 words a block
    dst = _host_blocks(3, tokens=1, head=3).view(3, -1)
    plan = plan_block_copy(src, dst)
    assert (plan.pieces, plan.piece_words, plan.word_bytes, plan.chunk_words) == (1, 6, 8, 4)
    pairs = [(2, 0), (0, 2)]
    expected = _expected(src, dst, pairs)
    swap_blocks(src, dst, _pairs(pairs))
    _sync()
    assert _same_bits(dst, expected)


@pytest.mark.parametrize(
    ("tokens", "head", "chunk_words"),
    [(BLOCK, HEAD, 4), (3, HEAD, 8), (1, 3, 2)],  # 16 words a piece in 4 chunks; 12 in 2, the last half masked; 3 in 2
)
def test_every_piece_of_a_strided_block_is_split_over_programs_too(
    monkeypatch: pytest.MonkeyPatch, tokens: int, head: int, chunk_words: int
) -> None:
    """Pieces and chunks both above one: the grid's second and third dimensions address words together."""
    monkeypatch.setattr(swap, "_CHUNK_WORDS", chunk_words)
    device = _device_blocks(5, seed=13, tokens=tokens, head=head)
    host = _host_blocks(4, seed=14, tokens=tokens, head=head)
    plan = plan_block_copy(device, host)
    assert plan.pieces == 2 * LAYERS and plan.chunk_words == chunk_words < plan.piece_words
    for src, dst, pairs in ((device, host, [(4, 0), (0, 3), (2, 1)]), (host, device, [(3, 3), (1, 0)])):
        expected = _expected(src, dst, pairs)
        swap_blocks(src, dst, _pairs(pairs))
        _sync()
        assert _same_bits(dst, expected)


def test_a_block_of_more_pieces_than_the_grid_holds_is_refused() -> None:
    src = torch.zeros(2, 70_000, 4, dtype=torch.bfloat16)[..., :2]  # a block: 70,000 runs of 2 elements
    with pytest.raises(MemoryContractError, match="70000 pieces of 2 elements exceeds the grid's 65535.*chunked path"):
        plan_block_copy(src, torch.zeros(2, 70_000, 2, dtype=torch.bfloat16))


def test_caches_of_different_blocks_are_refused() -> None:
    device, host = _device_blocks(3), _host_blocks(3)
    with pytest.raises(MemoryContractError, match=r"caches differ: src \(3, 2, 2, 4, 2, 8\) torch.bfloat16"):
        swap_blocks(device, host.float(), _pairs([(0, 0)]))
    with pytest.raises(MemoryContractError, match="caches differ"):
        plan_block_copy(device, host[:, :1])


def test_layouts_the_kernel_cannot_walk_are_refused_with_the_way_out() -> None:
    device, host = _device_blocks(3), _host_blocks(3, head=16)
    with pytest.raises(MemoryContractError, match="not evenly spaced runs.*TorchMigrator's chunked path"):
        plan_block_copy(host[..., ::2], device)  # the innermost elements are not contiguous
    layer_major_heads = _random((3, 2, LAYERS, HEADS, BLOCK, HEAD), torch.bfloat16, 0).transpose(3, 4)
    with pytest.raises(MemoryContractError, match="not evenly spaced"):
        plan_block_copy(layer_major_heads, device)  # runs of one head, at two spacings
    half_blocks = _random((3, 2, LAYERS, BLOCK, HEADS, 2 * HEAD), torch.bfloat16, 0)[..., :HEAD]
    with pytest.raises(MemoryContractError, match="do not line up"):
        plan_block_copy(half_blocks, device)  # runs of 8 every 16 elements against runs of 64


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (torch.tensor([[0, 3]]), "dst block\\(s\\) \\[3\\] out of range for 3 blocks"),
        (torch.tensor([[5, 0], [-1, 1]]), "src block\\(s\\) \\[-1, 5\\] out of range for 3 blocks"),
        (torch.tensor([[0, 1], [2, 1]]), "destination block is named twice in \\[1, 1\\]"),
        (torch.tensor([[0, 1]], dtype=torch.int32), "int64 tensor of \\(src block, dst block\\) rows"),
        (torch.tensor([0, 1]), "rows \\[n, 2\\], got torch.int64 \\(2,\\)"),
        (torch.tensor([[0, 1], [1, 2]]).t(), "must be contiguous"),
    ],
)
def test_bad_pairs_are_refused_before_the_launch(pairs: torch.Tensor, message: str) -> None:
    device, host = _device_blocks(3), _host_blocks(3)
    with pytest.raises(MemoryContractError, match=message):
        swap_blocks(device, host, pairs)  # checked before anything reads them, pinned or not
    assert not host.any()


@pytest.mark.skipif(not ON_GPU, reason="the interpreter reaches any host memory; a device only pinned memory")
def test_pageable_host_memory_is_refused_with_the_fix() -> None:
    with pytest.raises(MemoryContractError, match="src is pageable host memory.*pin_memory=True"):
        swap_blocks(torch.zeros(2, 8), torch.zeros(2, 8, device=DEVICE), _pairs([(0, 1)]))


# -------------------------------------------------------------------------------------------------
# The migrator: one launch below its threshold, TorchMigrator's chunked path above it
# -------------------------------------------------------------------------------------------------

BLOCK_BYTES = 2 * LAYERS * BLOCK * HEADS * HEAD * 2


def _migrator(**kwargs) -> FusedSwapMigrator:
    return FusedSwapMigrator(host_copies=not ON_GPU, **kwargs)


@pytest.mark.parametrize("direction", ["out", "in"])
def test_small_swaps_take_the_kernel_and_large_ones_the_chunked_path(direction: str) -> None:
    migrator = _migrator(kernel_below_bytes=3 * BLOCK_BYTES)
    device, host = _device_blocks(7, seed=5), _host_blocks(9, seed=6)
    for pairs, path in (([(3, 8), (0, 2)], "kernel"), ([(1, 0), (6, 5), (2, 4)], "torch"), ([(4, 4)], "kernel")):
        if direction == "in":
            pairs = [(h, d) for d, h in pairs]
        src, dst = (device, host) if direction == "out" else (host, device)
        expected = _expected(src, dst, pairs)
        before = dict(migrator.launches)
        migrator.copy_blocks(src, dst, torch.tensor(pairs)).wait()
        assert migrator.launches[path] == before[path] + 1, (pairs, migrator.launches)
        assert _same_bits(dst, expected)
    assert migrator.fallbacks == []


def test_a_kernel_copy_keeps_its_blocks_in_flight_until_its_handle_completes() -> None:
    migrator = _migrator()
    device, host = _device_blocks(4, seed=7), _host_blocks(4)
    handle = migrator.copy_blocks(device, host, [(1, 2), (3, 0)])
    assert migrator.launches == {"kernel": 1, "torch": 0}
    assert migrator.in_flight(device, 1) and migrator.in_flight(host, 2)
    with pytest.raises(MemoryContractError, match="in flight"):
        migrator.copy_blocks(device, host, [(0, 2)])  # writing a block being written
    with pytest.raises(MemoryContractError, match="in flight"):
        migrator.copy_blocks(host, device, [(1, 3)])  # writing a block being read
    handle.wait()
    assert handle.done() and not migrator.in_flight(device, 1) and not migrator.in_flight(host, 2)
    assert _same_bits(host[2], device[1]) and _same_bits(host[0], device[3])
    migrator.copy_blocks(host, device, [(2, 3)]).wait()  # the pairs buffer is reused
    assert _same_bits(device[3], device[1]) and len(migrator._pair_buffers) == 1


class _StillRead:
    """The event of a kernel that has not run yet: the pairs buffer it reads must not be rewritten."""

    def query(self) -> bool:
        return False


def test_a_pairs_buffer_a_kernel_may_still_read_is_not_rewritten() -> None:
    migrator = _migrator()
    device, host = _device_blocks(4, seed=15), _host_blocks(4)
    migrator.copy_blocks(device, host, [(1, 2), (3, 0)]).wait()
    (first,) = migrator._pair_buffers
    first[2] = _StillRead()
    migrator.copy_blocks(host, device, [(2, 0)]).wait()
    assert len(migrator._pair_buffers) == 2 and first[0][:2].tolist() == [[1, 2], [3, 0]]
    assert _same_bits(device[0], device[1])  # host block 2 held device block 1
    first[2] = None  # its kernel has run: the buffer serves again
    migrator.copy_blocks(device, host, [(0, 1)]).wait()
    assert len(migrator._pair_buffers) == 2 and _same_bits(host[1], device[0])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch.cuda._sleep holds the kernels back on a CUDA device")
def test_copies_queued_before_any_runs_each_read_their_own_pairs() -> None:
    """Three swaps queued behind a busy stream: no kernel has run when the next copy picks its pairs buffer."""
    migrator = _migrator()
    device, host = _device_blocks(6, seed=16), _host_blocks(6)
    migrator.copy_blocks(device, host, [(0, 0)]).wait()  # compiled and planned before the clock matters
    swaps = [[(0, 5), (1, 4)], [(2, 3)], [(3, 2), (4, 1), (5, 0)]]
    torch.cuda._sleep(200_000_000)  # about 0.1 s of the current stream, which every copy waits for
    handles = [migrator.copy_blocks(device, host, pairs) for pairs in swaps]
    assert not any(h.done() for h in handles) and len(migrator._pair_buffers) == len(swaps)
    for handle in handles:
        handle.wait()
    for pairs in swaps:
        assert all(_same_bits(host[h], device[d]) for d, h in pairs), pairs
    assert migrator.launches == {"kernel": 1 + len(swaps), "torch": 0}


def test_a_threshold_of_zero_never_takes_the_kernel_and_a_bad_one_is_refused() -> None:
    migrator = _migrator(kernel_below_bytes=0)
    device, host = _device_blocks(2, seed=8), _host_blocks(2)
    migrator.copy_blocks(device, host, [(0, 1)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and _same_bits(host[1], device[0])
    with pytest.raises(MemoryContractError, match="kernel_below_bytes must be an int >= 0, got -1"):
        FusedSwapMigrator(kernel_below_bytes=-1)


@pytest.mark.skipif(ON_GPU, reason="on a GPU the kernel serves device <-> pinned host copies")
def test_host_copies_take_the_kernel_only_when_asked() -> None:
    migrator = FusedSwapMigrator()
    host_a, host_b = _host_blocks(2, seed=9), _host_blocks(2)
    migrator.copy_blocks(host_a, host_b, [(0, 1)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and _same_bits(host_b[1], host_a[0])


@pytest.mark.skipif(not ON_GPU, reason="needs a device and pageable host memory")
def test_pageable_host_memory_takes_the_chunked_path() -> None:
    migrator = _migrator()
    device, host = _device_blocks(2, seed=10), torch.zeros(2, 2, LAYERS, BLOCK, HEADS, HEAD, dtype=torch.bfloat16)
    migrator.copy_blocks(device, host, [(1, 0)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and _same_bits(host[0], device[1])


def test_a_failing_launch_falls_back_to_the_chunked_path_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(swap, "swap_blocks", broken)
    migrator = _migrator()
    device, host = _device_blocks(3, seed=11), _host_blocks(3)
    migrator.copy_blocks(device, host, [(2, 0)]).wait()
    assert _same_bits(host[0], device[2]) and migrator.launches == {"kernel": 0, "torch": 1}
    (why,) = migrator.fallbacks
    assert "the swap kernel raised ValueError: Pointer argument (at 2)" in why and "chunked copies" in why
    migrator.copy_blocks(host, device, [(0, 1)]).wait()  # given up: no second attempt, no second record
    assert migrator.launches == {"kernel": 0, "torch": 2} and len(migrator.fallbacks) == 1


def test_a_swap_kernel_that_cannot_be_imported_is_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm_port.kernels.triton", None)  # as if triton were not installed
    migrator = _migrator()
    device, host = _device_blocks(3, seed=17), _host_blocks(3)
    migrator.copy_blocks(device, host, [(0, 1)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and _same_bits(host[1], device[0])
    (why,) = migrator.fallbacks
    assert why.startswith("FusedSwapMigrator: the swap kernel cannot be imported") and "chunked copies" in why


def test_a_plan_that_raises_is_a_fallback_and_leaves_nothing_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a layout nobody planned for")

    monkeypatch.setattr(swap, "plan_block_copy", broken)
    migrator = _migrator()
    device, host = _device_blocks(3, seed=19), _host_blocks(3)
    migrator.copy_blocks(device, host, [(2, 0)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and _same_bits(host[0], device[2])
    assert "ZeroDivisionError" in migrator.fallbacks[0]
    assert not migrator.in_flight(host, 0)


def test_a_copy_that_raises_leaves_no_block_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of staging memory")

    migrator = _migrator(kernel_below_bytes=0)  # the chunked path, which here fails
    monkeypatch.setattr(TorchMigrator, "_launch", broken)
    device, host = _device_blocks(3, seed=20), _host_blocks(3)
    with pytest.raises(RuntimeError, match="out of staging memory"):
        migrator.copy_blocks(device, host, [(1, 1)])
    assert not migrator.in_flight(device, 1) and not migrator.in_flight(host, 1)
    monkeypatch.undo()
    migrator.copy_blocks(device, host, [(1, 1)]).wait()  # the same blocks copy again: nothing was left held
    assert _same_bits(host[1], device[1])


def test_a_layout_the_kernel_cannot_walk_takes_the_chunked_path_without_a_fallback() -> None:
    migrator = _migrator()
    device = _random((2, 70_000, 4), torch.bfloat16, 18).to(DEVICE)[..., :2]  # more pieces than the grid holds
    host = torch.zeros(2, 70_000, 2, dtype=torch.bfloat16, pin_memory=ON_GPU)
    migrator.copy_blocks(device, host, [(1, 0)]).wait()
    assert migrator.launches == {"kernel": 0, "torch": 1} and migrator.fallbacks == []
    assert _same_bits(host[0], device[1])


def test_strict_mode_refuses_the_fallback_and_leaves_nothing_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(swap, "swap_blocks", broken)
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    migrator = _migrator()
    device, host = _device_blocks(3, seed=12), _host_blocks(3)
    with pytest.raises(StrictModeError, match="refuses a fallback: FusedSwapMigrator: the swap kernel raised"):
        migrator.copy_blocks(device, host, [(1, 2)])
    assert not migrator.in_flight(device, 1) and not migrator.in_flight(host, 2)
    assert _same_bits(host[2], device[1])  # the chunked path made the copy before the refusal


def test_the_swap_bench_says_which_path_made_each_row() -> None:
    layout = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD, block_size=BLOCK, dtype=torch.bfloat16)
    device_memory = TorchDeviceAllocator(DEVICE) if ON_GPU else HostMemoryAllocator(pinned=False)
    device = KVCache(device_memory, layout, 8 * BLOCK_BYTES)
    host = KVCache(HostMemoryAllocator(pinned=ON_GPU), layout, 8 * BLOCK_BYTES, block_major=True)
    migrator = _migrator(kernel_below_bytes=4 * BLOCK_BYTES)
    rows = bench_swap.measure(migrator, device, host, None, counts=(2, 5), repeats=1, patterns=("scattered",))
    assert [(r["direction"], r["blocks"], r["path"]) for r in rows] == [
        ("out", 2, "kernel"),
        ("in", 2, "kernel"),
        ("out", 5, "torch"),
        ("in", 5, "torch"),
    ]
    for kv in (device, host):
        kv.close()


@pytest.mark.slow
def test_every_swap_class_of_the_conformance_suite_takes_the_kernel_bit_exact() -> None:
    # the suite's swap classes (1, 64, 65, 200 blocks; runs and scattered, to the last block; both
    # directions; pairs as a list and as a tensor) through the one-launch path the CUDA plugin takes
    from vllm_port_conformance.comm_memory_classes import SWAP_DEVICE_BLOCKS, SWAP_SPACE_BLOCKS
    from vllm_port_conformance.swap_check import check_swap_classes

    migrator = _migrator()
    device, host = _device_blocks(SWAP_DEVICE_BLOCKS), _host_blocks(SWAP_SPACE_BLOCKS, seed=1)
    check_swap_classes(migrator, device, host, "FusedSwapMigrator")
    assert migrator.launches["torch"] == 0 and migrator.launches["kernel"] > 0 and migrator.fallbacks == []
