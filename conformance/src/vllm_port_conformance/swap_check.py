"""Every swap class of :data:`~vllm_port_conformance.comm_memory_classes.SWAP_CLASSES`, through one migrator.

Shared by the memory checks (the plugin's migrator, between its tiers) and core's tests (the
Triton swap kernel in the interpreter). Each class is copied in both directions, each direction
checked on its own against a copy made by indexing: every pair's destination block holds its
source block's bits, and every other block of the destination, and the whole source, keeps its own.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_port_conformance.comm_memory_classes import SWAP_CLASSES, SwapClass, swap_pairs

__all__ = ["check_swap_classes"]


def _bits(blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' bits on the host, one row per block (NaN payloads compare as bits)."""
    return blocks.detach().cpu().contiguous().view(torch.uint8).reshape(blocks.shape[0], -1)


def _fill(blocks: torch.Tensor, seed: int) -> None:
    """Random bits into every block (through the view: a cache's blocks are strided)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (*blocks.shape[:-1], blocks.shape[-1] * blocks.element_size()), generator=g)
    blocks.copy_(noise.to(torch.uint8).view(blocks.dtype).to(blocks.device))


def _mapping(pairs: list[tuple[int, int]], form: str) -> Any:
    return torch.tensor(pairs, dtype=torch.int64) if form == "tensor" else pairs


def _first_problem(
    before_src: torch.Tensor,
    before_dst: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    pairs: list[tuple[int, int]],
) -> str:
    """What is wrong after copying ``pairs`` from ``before_src`` into ``before_dst`` (empty when nothing is)."""
    got, want = _bits(dst), before_dst.clone()
    want[[b for _, b in pairs]] = before_src[[a for a, _ in pairs]]
    wrong = (got != want).any(dim=1).nonzero().flatten().tolist()
    if wrong:
        where = {b: i for i, (_, b) in enumerate(pairs)}
        block = wrong[0]
        if block in where:
            i = where[block]
            old = " (it kept its old bits: not copied)" if torch.equal(got[block], before_dst[block]) else ""
            return (
                f"{len(wrong)} destination block(s) wrong; the first, pair {i} of {len(pairs)} "
                f"(block {pairs[i][0]} -> block {block}), does not hold its source's bits{old}"
            )
        return f"{len(wrong)} destination block(s) wrong; the first, block {block}, is named in no pair and changed"
    changed = (_bits(src) != before_src).any(dim=1).nonzero().flatten().tolist()
    if changed:
        return f"the copy changed {len(changed)} source block(s), the first block {changed[0]}"
    return ""


def check_swap_classes(migrator: Any, device: torch.Tensor, swap: torch.Tensor, who: str) -> None:
    """Swap every class out of ``device`` into ``swap`` and in from ``swap`` into ``device``.

    :param device: the device cache's blocks (``KVCache.blocks``); overwritten.
    :param swap: the swap space's blocks, as many as the largest swap needs or more; overwritten.
    :param who: names the plugin, the migrator and the caches in every failure.
    :raises AssertionError: naming the class, the direction, the pair and the block that went wrong.
    """
    largest = max(c.num_pairs for c in SWAP_CLASSES)
    assert min(device.shape[0], swap.shape[0]) > largest, (
        f"{who}: the swap check needs caches of more than {largest} blocks, got {device.shape[0]} and {swap.shape[0]}"
    )
    for k, swap_class in enumerate(SWAP_CLASSES):
        for direction, src, dst in (("swap-out", device, swap), ("swap-in", swap, device)):
            _fill(src, seed=2 * k)
            _fill(dst, seed=2 * k + 1)
            before_src, before_dst = _bits(src), _bits(dst)
            pairs = swap_pairs(swap_class, src.shape[0], dst.shape[0], seed=k)
            migrator.copy_blocks(src, dst, _mapping(pairs, swap_class.form)).wait()
            problem = _first_problem(before_src, before_dst, src, dst, pairs)
            assert not problem, f"{who}: {direction} of {_describe(swap_class, src, dst)}: {problem}"


def _describe(swap_class: SwapClass, src: torch.Tensor, dst: torch.Tensor) -> str:
    return f"{swap_class.label} (from a cache of {src.shape[0]} blocks into one of {dst.shape[0]})"
