"""The input classes the comm and memory checks cover, declared in one place.

Each class is one the engine reaches or the contract allows, at the sizes where implementations
switch algorithm, chunk or protocol; the checks are generated from these tables, so a class added
here is checked everywhere it applies.

What the engine passes (core's ``engine/tensor_parallel.py``, ``sharded_layers.py``, ``engine/runner.py``):

* ``all_reduce``: the partial products of the row-parallel linears (o_proj, down_proj) and the
  vocabulary-parallel embedding, ``[tokens, hidden]`` in the model's dtype (float32, bfloat16,
  float16): from a decode step's few rows to a prefill chunk past 2^24 elements (8192 tokens of a
  4096-wide model). The contract allows every dtype of :data:`vllm_port.comm.SUPPORTED_DTYPES`;
  int64 (token ids, counts, positions) reach past 2^24 (a float32 round trip corrupts them), past
  2^31 (an int32 truncation does) and up to 2^62.
* ``all_gather(dim=-1)``: the parallel LM head's logits, ``[rows, vocabulary shard]``, uneven when
  the vocabulary does not split evenly (``split_range``): the shards differ by one column.
* ``broadcast``, ``reduce_scatter``, ``send``/``recv``/``batch_isend_irecv``: not on the engine's
  path today; the contract allows them for every supported dtype, any size, and reduce_scatter over
  sizes that do not divide by the ranks.
* The migrator: ``copy_blocks(kv.blocks, swap.blocks, pairs)`` swaps a preempted sequence's whole
  block table out (a 4096-token sequence at block size 16 is 256 blocks), and the reverse swaps it
  in, each side's ids as the pools handed them out (scattered, the last block of a pool included).
  The engine passes a Python list of ``(src, dst)`` pairs; the contract's protocol names a tensor
  (int64, ``[n, 2]``). The swap space is block-major, the device cache layer-major.
* The allocator: the KV cache and the swap space are each one buffer of a whole number of blocks,
  tens of MiB to GiB, rarely a multiple of a 2 MiB huge page; small buffers (staging, metadata)
  beside them.
* The block pool: one allocation takes a whole block table; ``hash_block`` hashes ``block_size``
  token ids, each up to the vocabulary (128,256 for Llama 3, 151,936 for Qwen: past 2^16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_port.comm import SUPPORTED_DTYPES

__all__ = [
    "ALLOCATION_SIZES",
    "COMM_CALLS",
    "COMM_DTYPES",
    "INT_VALUE_CLASSES",
    "LARGE_ALL_REDUCE",
    "MESSAGE_SIZES",
    "POOL_ALLOCATIONS",
    "SWAP_CLASSES",
    "TOKEN_ID_CLASSES",
    "MessageSize",
    "SwapClass",
    "message_numel",
    "swap_pairs",
    "wide_values",
]

#: every dtype the contract allows, checked for every call
COMM_DTYPES: tuple[torch.dtype, ...] = SUPPORTED_DTYPES
#: the calls checked per dtype, each over every message size
COMM_CALLS = ("all_reduce", "all_gather", "all_gather_uneven", "reduce_scatter", "broadcast", "p2p")


@dataclass(frozen=True)
class MessageSize:
    """A message size class: just past ``boundary_bytes`` (a few elements more, an odd count)."""

    label: str
    boundary_bytes: int


#: sizes where implementations switch protocol or chunk: a decode step's few values, the eager /
#: rendezvous switch and chunk size of many transports (64 KiB), and the next algorithm switch (1 MiB)
MESSAGE_SIZES = (
    MessageSize("a few values", 0),
    MessageSize("past 64 KiB", 64 << 10),
    MessageSize("past 1 MiB", 1 << 20),
)
#: elements past the boundary: odd (no even split over ranks), and not a whole 16-byte vector in any dtype
_PAST = 3


def message_numel(size: MessageSize, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a message of class ``size``: the boundary's worth and 3 more (odd)."""
    return size.boundary_bytes // _itemsize(dtype) + _PAST + (4 if size.boundary_bytes == 0 else 0)


@dataclass(frozen=True)
class LargeAllReduce:
    """The prefill chunk's all-reduce: more elements than a 24-bit count holds."""

    dtype: torch.dtype
    numel: int


LARGE_ALL_REDUCE = LargeAllReduce(torch.bfloat16, (1 << 24) + _PAST)

#: int64 magnitudes a narrower transport corrupts: past float32's 2^24, int32's 2^31, float64's 2^53,
#: and near 2^62 (halved per extra rank so the sum stays in range)
INT_VALUE_CLASSES: dict[torch.dtype, tuple[int, ...]] = {
    torch.int64: ((1 << 24) + 1, (1 << 31) + 1, (1 << 53) + 1, (1 << 62) - 1),
    torch.int32: ((1 << 16) + 1, (1 << 24) + 1, (1 << 30) - 1),
    torch.int8: (1, 63),
    torch.uint8: (1, 127),
}


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def wide_values(dtype: torch.dtype, numel: int, rank: int, world: int, device: torch.device | str) -> torch.Tensor:
    """``numel`` values of ``dtype`` that use its whole width, differ per rank, and sum over ``world`` ranks exactly.

    Floats are ``m * 2^e`` with ``m`` filling the significand (less a bit per doubling of ranks)
    and ``e`` sweeping the normal range, the same ``e`` and sign on every rank: a transport in a
    narrower float rounds or overflows them. Integers sweep :data:`INT_VALUE_CLASSES` and their
    negatives (unsigned: not), scaled so ``world`` of them still fit.
    """
    i = torch.arange(numel, dtype=torch.int64)
    headroom = max(1, math.ceil(math.log2(max(world, 1))))
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        nmant = round(-math.log2(info.eps))  # stored significand bits
        bits = nmant + 1 - headroom
        m = (1 << (bits - 1)) + (i * 2654435761 + rank * 40503) % (1 << (bits - 1))
        # every value normal, every sum of ``world`` values below the dtype's max
        low, high = round(math.log2(info.tiny)) - bits + 1, math.floor(math.log2(info.max)) - nmant
        e = low + (i * 7) % (high - low + 1)
        sign = 1 - 2 * ((i // 3) % 2)
        return torch.ldexp((sign * m).to(torch.float64), e.to(torch.float64)).to(dtype=dtype, device=device)
    tops = torch.tensor([v // (1 << (headroom - 1)) for v in INT_VALUE_CLASSES[dtype]], dtype=torch.int64)
    top = tops[i % len(tops)]
    values = top - (i // len(tops) + 7 * rank) % (top // 2 + 1)  # within [top/2, top]: never past top
    if dtype != torch.uint8:
        values = torch.where((i // len(tops)) % 2 == 1, -values, values)
    return values.to(dtype=dtype, device=device)


# -------------------------------------------------------------------------------------------------
# Memory: swaps of the migrator, allocations and hashes of the block pool
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SwapClass:
    """One class of ``copy_blocks`` mapping: how many pairs, laid out how, passed as what."""

    num_pairs: int
    #: ``"runs"``: consecutive ids on both sides; ``"scattered"``: runs on one side only, the other
    #: side shuffled, the last block of both pools included
    pattern: str
    #: ``"list"`` (the engine's ``[(src, dst), ...]``) or ``"tensor"`` (int64 ``[n, 2]``)
    form: str

    @property
    def label(self) -> str:
        return f"{self.num_pairs} block(s), {self.pattern}, as a {self.form}"


#: one block; a launch grid's or a pair buffer's 64 rows, and one past; a long sequence's block table
SWAP_COUNTS = (1, 64, 65, 200)
SWAP_CLASSES = tuple(
    SwapClass(n, pattern, form) for n in SWAP_COUNTS for pattern in ("runs", "scattered") for form in ("list", "tensor")
)
#: blocks of the device cache and of the swap space the swap checks use: more than the largest
#: swap, odd, so no power-of-two layout lines up with the last block
SWAP_DEVICE_BLOCKS, SWAP_SPACE_BLOCKS = 257, 203


def swap_pairs(swap: SwapClass, src_blocks: int, dst_blocks: int, seed: int) -> list[tuple[int, int]]:
    """The ``(src, dst)`` pairs of ``swap`` between caches of ``src_blocks`` and ``dst_blocks`` blocks.

    ``"runs"`` starts at an odd offset on both sides (one block: the first of both). ``"scattered"`` keeps runs of the source ids
    (as a sequence's block table has them) against shuffled destination ids, and names the last
    block of both caches in its last pair.
    """
    n = swap.num_pairs
    if swap.pattern == "runs":
        return [(1 + k, 3 + k) for k in range(n)] if n > 1 else [(0, 0)]
    g = torch.Generator().manual_seed(seed)
    src = torch.randperm(src_blocks - 1, generator=g)[: n - 1].sort().values.tolist()  # ascending: runs
    dst = torch.randperm(dst_blocks - 1, generator=g)[: n - 1].tolist()  # shuffled: no run survives
    return [*zip(src, dst, strict=True), (src_blocks - 1, dst_blocks - 1)]


#: bytes of the buffers the allocator checks hold live at once: small and odd sizes a caching allocator
#: hands out again, and buffers of several huge pages (2 MiB) with a remainder, as a KV cache of whole
#: blocks is: an arena or huge-page path that rounds or aligns them wrongly makes two of them overlap
ALLOCATION_SIZES = (4096, 3 * 4096 + 5, 4096, 1, 1 << 20, 4096, (8 << 20) + 12_288, (3 << 20) + 5, (16 << 20) + 4096)


#: blocks of the pool the allocation check uses, and the batches it takes them in (a decode step's
#: one block, 64, 65, and the rest: the last block included)
POOL_BLOCKS = 257
POOL_ALLOCATIONS = (1, 64, 65, POOL_BLOCKS - 130)
#: token ids past the byte and 16-bit boundaries, the largest real vocabularies' last ids, and int32's top
TOKEN_ID_CLASSES = (0, 255, 256, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 128_255, 151_935, (1 << 31) - 1)
#: tokens per block in the hash check: the engine's default block size
HASH_BLOCK_SIZE = 16
