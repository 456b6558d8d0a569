"""Swap kernel: copy whole KV blocks between a device cache and a pinned-host cache in one launch.

``dst[pairs[i, 1]] = src[pairs[i, 0]]`` for every pair, bit for bit. One side may be page-locked
host memory: with unified virtual addressing a pinned tensor's ``data_ptr()`` is valid on the
device, so the kernel writes the host cache directly (swap-out) or reads it (swap-in), and the
pairs themselves can stay in pinned memory too. A swap is then one launch and no staging copy,
where the chunked path of :class:`vllm_port.memory.TorchMigrator` pays about 25 torch calls of
host time per call (docs/results/swap-h200.md): what keeps swaps of a few blocks far below the link.

A block may be a strided view (``KVCache.blocks`` of a layer-major cache: one piece per layer's
keys and values, ``num_blocks`` pieces apart). :func:`plan_block_copy` expresses both sides as
``pieces`` contiguous runs of ``piece_words`` words, a fixed stride apart, in the widest word
(8, 4, 2 or 1 bytes) that every address and stride allows. The grid is (pair, piece, chunk of the
piece): a one-block swap of a Llama-3-8B cache (2 MiB) still spreads over 256 programs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...errors import MemoryContractError
from .launch import cached_launch, cdiv, next_power_of_2

__all__ = ["BlockCopyPlan", "plan_block_copy", "swap_blocks"]

#: Words a program copies at most: 8 KiB of int64, 8 words (four 16-byte vectors) per thread of 4 warps.
_CHUNK_WORDS = 1024
_NUM_WARPS = 4
#: CUDA's limit on the second and third grid dimensions (pieces, chunks of a piece).
_MAX_GRID_DIM = 65535
_WORDS = {
    8: (torch.int64, tl.int64),
    4: (torch.int32, tl.int32),
    2: (torch.int16, tl.int16),
    1: (torch.uint8, tl.uint8),
}


@cached_launch
@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    pairs_ptr,
    src_block_stride,
    src_piece_stride,
    dst_block_stride,
    dst_piece_stride,
    piece_words,
    CHUNK: tl.constexpr,
):
    """Copy chunk ``pid2`` of piece ``pid1`` of block ``pairs[pid0, 0]`` of src into block ``pairs[pid0, 1]`` of dst.

    Args:
        src_ptr, dst_ptr: the caches' first words (device memory or mapped pinned host memory).
        pairs_ptr: int64 ``[n, 2]`` (source block, destination block), rows contiguous; read
            through the mapping when it lies in pinned host memory.
        src_block_stride, dst_block_stride: words from one block to the next.
        src_piece_stride, dst_piece_stride: words from one contiguous piece of a block to the next.
        piece_words: words in a piece.
        CHUNK: words per program (a power of two).

    Triton specialises strides and addresses divisible by 16, so int64 words of 16-byte aligned
    caches compile to 16-byte vector loads and stores.
    """
    pair = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1).to(tl.int64)
    words = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    src_block = tl.load(pairs_ptr + 2 * pair)
    dst_block = tl.load(pairs_ptr + 2 * pair + 1)
    mask = words < piece_words
    src = src_ptr + src_block * src_block_stride + piece * src_piece_stride
    dst = dst_ptr + dst_block * dst_block_stride + piece * dst_piece_stride
    # every word is read once: keep it out of the cache the model's kernels use
    values = tl.load(src + words, mask=mask, eviction_policy="evict_first")
    tl.store(dst + words, values, mask=mask)


@dataclass(frozen=True)
class BlockCopyPlan:
    """How :func:`swap_blocks` walks one block of two caches; every length and stride in words.

    A block is ``pieces`` runs of ``piece_words`` contiguous words; run ``k`` of block ``b`` starts
    ``b * block_stride + k * piece_stride`` words after the cache's first element.
    """

    word_bytes: int
    pieces: int
    piece_words: int
    src_block_stride: int
    src_piece_stride: int
    dst_block_stride: int
    dst_piece_stride: int

    @property
    def chunk_words(self) -> int:
        """Words one program copies."""
        return min(_CHUNK_WORDS, next_power_of_2(self.piece_words))

    @property
    def block_bytes(self) -> int:
        """Bytes in one block."""
        return self.pieces * self.piece_words * self.word_bytes


def _runs(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """One block of ``t`` (``t[0]``'s dims) as (count, stride) dims, merged where they are contiguous
    across; the innermost has stride 1. ``None`` when the innermost elements are not contiguous."""
    dims: list[tuple[int, int]] = []  # innermost first
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:]), strict=True):
        if size == 1:
            continue
        if dims and stride == dims[-1][0] * dims[-1][1]:
            dims[-1] = (dims[-1][0] * size, dims[-1][1])
        else:
            dims.append((size, stride))
    if not dims:
        return [(1, 1)]
    return list(reversed(dims)) if dims[0][1] == 1 else None


def _pieces(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    runs = _runs(t)
    if runs is None or len(runs) > 2:
        raise MemoryContractError(
            f"swap_blocks: a block of {name} (shape {tuple(t.shape)}, strides {t.stride()}) is not evenly spaced "
            "runs of contiguous elements; copy it with TorchMigrator's chunked path"
        )
    if len(runs) == 1:
        return 1, runs[0][0], runs[0][0]
    (count, stride), (length, _) = runs
    return count, length, stride


def plan_block_copy(src: torch.Tensor, dst: torch.Tensor) -> BlockCopyPlan:
    """The plan that copies blocks (dim 0) of ``src`` into blocks of ``dst``: their common pieces and the widest word.

    :raises MemoryContractError: for caches of different dtypes or block shapes, or a block layout
        the kernel cannot walk (not evenly spaced contiguous runs, or runs that do not line up).
    """
    if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:]:
        raise MemoryContractError(
            f"swap_blocks: caches differ: src {tuple(src.shape)} {src.dtype}, dst {tuple(dst.shape)} {dst.dtype}; "
            "both must hold blocks of one shape and dtype"
        )
    (s_count, s_length, s_stride), (d_count, d_length, d_stride) = _pieces("src", src), _pieces("dst", dst)
    # a contiguous block splits into any runs that divide it: the finer side's runs are the common ones
    if s_length == d_length:
        length = s_length
    elif s_count == 1 and s_length % d_length == 0:
        length, s_stride = d_length, d_length
    elif d_count == 1 and d_length % s_length == 0:
        length, d_stride = s_length, s_length
    else:
        raise MemoryContractError(
            f"swap_blocks: the blocks of src (strides {src.stride()}) and dst (strides {dst.stride()}) are laid out in "
            f"runs that do not line up ({s_count} x {s_length} and {d_count} x {d_length} elements); copy them with "
            "TorchMigrator's chunked path"
        )
    pieces = math.prod(src.shape[1:]) // length
    itemsize = src.element_size()
    # a stride that is never multiplied by a nonzero index (one block, one piece) does not limit the word
    src_block = src.stride(0) if src.shape[0] > 1 else 0
    dst_block = dst.stride(0) if dst.shape[0] > 1 else 0
    s_stride, d_stride = (s_stride, d_stride) if pieces > 1 else (0, 0)
    elements = (length, src_block, dst_block, s_stride, d_stride)
    common = math.gcd(*(e * itemsize for e in elements), src.data_ptr(), dst.data_ptr())
    word = next(w for w in _WORDS if common % w == 0)

    def words(elements: int) -> int:  # exact: word divides every byte count above
        return elements * itemsize // word

    if pieces > _MAX_GRID_DIM or cdiv(words(length), _CHUNK_WORDS) > _MAX_GRID_DIM:
        raise MemoryContractError(
            f"swap_blocks: a block of {pieces} pieces of {length} elements exceeds the grid's {_MAX_GRID_DIM} "
            "pieces or chunks; copy it with TorchMigrator's chunked path"
        )
    return BlockCopyPlan(
        word_bytes=word,
        pieces=pieces,
        piece_words=words(length),
        src_block_stride=words(src_block),
        src_piece_stride=words(s_stride),
        dst_block_stride=words(dst_block),
        dst_piece_stride=words(d_stride),
    )


def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: torch.Tensor,
    plan: BlockCopyPlan | None = None,
    *,
    num_pairs: int | None = None,
    check: bool = True,
) -> None:
    """Copy block ``pairs[i, 0]`` of ``src`` into block ``pairs[i, 1]`` of ``dst`` for every ``i``, in one launch.

    Runs on the current stream and returns without waiting. Off the interpreter, each of ``src``,
    ``dst`` and ``pairs`` is either on the device that runs the kernel or in pinned host memory.

    :param pairs: int64 ``[n, 2]``, rows contiguous; only its first ``num_pairs`` rows are read
        (all when ``None``), so a caller may keep one larger pinned buffer.
    :param plan: :func:`plan_block_copy`'s answer for these caches, when the caller keeps it.
    :param check: check devices, pairs' range and distinct destinations (reads ``pairs`` on the host;
        a caller that has checked them, like the migrator, passes ``False``).
    :raises MemoryContractError: for caches of different block shapes or dtypes, a layout the kernel
        cannot walk, host memory the device cannot reach, or pairs malformed or out of range.
    """
    n = pairs.shape[0] if num_pairs is None else num_pairs
    if check:
        _check(src, dst, pairs, n)
    if n == 0:
        return
    plan = plan or plan_block_copy(src, dst)
    _, word = _WORDS[plan.word_bytes]
    grid = (n, plan.pieces, cdiv(plan.piece_words, plan.chunk_words))
    _copy_blocks_kernel[grid](
        triton.reinterpret(src, word),
        triton.reinterpret(dst, word),
        pairs,
        plan.src_block_stride,
        plan.src_piece_stride,
        plan.dst_block_stride,
        plan.dst_piece_stride,
        plan.piece_words,
        CHUNK=plan.chunk_words,
        num_warps=_NUM_WARPS,
    )


def _check(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor, n: int) -> None:
    if not isinstance(pairs, torch.Tensor) or pairs.dtype != torch.int64 or pairs.dim() != 2 or pairs.shape[1] != 2:
        raise MemoryContractError(
            f"swap_blocks: pairs must be an int64 tensor of (src block, dst block) rows [n, 2], got {_describe(pairs)}"
        )
    if pairs.stride() != (2, 1) or not 0 <= n <= pairs.shape[0]:
        raise MemoryContractError(
            f"swap_blocks: pairs must be contiguous with at least num_pairs={n} rows, got {_describe(pairs)}"
        )
    rows = pairs[:n].tolist()
    for name, column, blocks in (("src", 0, src.shape[0]), ("dst", 1, dst.shape[0])):
        bad = sorted({row[column] for row in rows if not 0 <= row[column] < blocks})
        if bad:
            raise MemoryContractError(f"swap_blocks: {name} block(s) {bad} out of range for {blocks} blocks")
    destinations = [row[1] for row in rows]
    if len(set(destinations)) != len(destinations):
        raise MemoryContractError(
            f"swap_blocks: a destination block is named twice in {destinations}; each block can take one source"
        )
    if not _interpreted(_copy_blocks_kernel):  # the interpreter reaches any host memory
        _check_reachable(src, dst, pairs)


def _interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

    Read from ``sys.modules``, never imported: the interpreter module imports numpy, which Triton
    does not depend on (a GPU install without numpy must still load the kernels). An interpreted
    kernel exists only once ``triton.jit`` has imported that module.
    """
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(kernel, interpreter.InterpretedFunction)


def _check_reachable(src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
    """Every operand on one device, or in host memory the device maps (pinned)."""
    devices = {t.device for t in (src, dst, pairs) if t.device.type != "cpu"}
    if len(devices) != 1:
        raise MemoryContractError(
            f"swap_blocks: src on {src.device}, dst on {dst.device}, pairs on {pairs.device}: the kernel needs one "
            "device (and host memory it can map); move the operands onto one device"
        )
    for name, t in (("src", src), ("dst", dst), ("pairs", pairs)):
        if t.device.type == "cpu" and t.numel() and not t.is_pinned():  # an empty tensor has no memory to pin
            raise MemoryContractError(
                f"swap_blocks: {name} is pageable host memory, which the device cannot reach; allocate it pinned "
                "(torch's pin_memory=True, or the platform's pinned_host tier)"
            )


def _describe(pairs: object) -> str:
    if isinstance(pairs, torch.Tensor):
        return f"{pairs.dtype} {tuple(pairs.shape)} strides {pairs.stride()} on {pairs.device}"
    return type(pairs).__name__
