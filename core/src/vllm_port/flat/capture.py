"""Decode steps captured once per batch size and replayed, the batch padded up to the nearest captured size.

:class:`DecodeGraphs` owns static input buffers for the largest batch size, captures the step
(eager bound kernels or a compiled step, anything that does not synchronise with the host) on
views of them for each size in ``batch_sizes`` through the platform's
:class:`~vllm_port.graph_capture.GraphCapture`, and at run time copies a batch of ``n`` sequences into
the buffers, pads rows ``n..b`` of the smallest captured size ``b >= n`` as padding sequences
(``slot_mapping`` -1: nothing is written to the cache; ``seq_lens`` 0: attention reads nothing and
gives a zero row; token 0 at position 0), replays, and returns the first ``n`` rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from ..graph_capture import GraphCapture, capturing

__all__ = ["DEFAULT_BATCH_SIZES", "DecodeGraphs", "DecodeStep", "padded_batch_sizes"]

#: Captured batch sizes by default: every size to 8, then steps of 8 (vLLM's choice, for the same reason:
#: small batches are latency-bound and padding them costs most).
DEFAULT_BATCH_SIZES = (1, 2, 4, *range(8, 513, 8))

#: ``step(input_ids, positions, slot_mapping, block_tables, seq_lens) -> Tensor`` with one output row per sequence.
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def padded_batch_sizes(max_batch: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> list[int]:
    """The sizes of ``sizes`` up to ``max_batch``, plus ``max_batch`` itself, sorted."""
    if max_batch < 1:
        raise ValueError(f"padded_batch_sizes: max_batch must be >= 1, got {max_batch}")
    return sorted({s for s in sizes if 0 < s < max_batch} | {max_batch})


class DecodeGraphs:
    """A decode step captured at ``batch_sizes``; call it like the step, with any batch up to the largest size.

    :param step: the decode step; it must read its inputs only from its arguments and not
        synchronise with the host (the KV caches it closes over keep their addresses).
    :param capture: the platform's graph capture (``runtime.graph_capture()``).
    :param batch_sizes: the sizes to capture; a batch of ``n`` replays the smallest size ``>= n``.
    :param max_blocks_per_seq: width of the static block table (the longest context / block size).
    :param device: where the static buffers live (the model's device).
    :param pad_seq_len: ``seq_lens`` of padding rows (0: a padding sequence, which the attention
        ops define as reading nothing; a kernel without that rule can use 1 with block 0 as scratch).
    """

    def __init__(
        self,
        step: DecodeStep,
        capture: GraphCapture,
        batch_sizes: Sequence[int],
        max_blocks_per_seq: int,
        device: torch.device | str,
        pad_seq_len: int = 0,
        warmup: int = 2,
    ) -> None:
        sizes = sorted(set(batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"DecodeGraphs: batch_sizes must be positive ints, got {list(batch_sizes)}")
        if max_blocks_per_seq < 1:
            raise ValueError(f"DecodeGraphs: max_blocks_per_seq must be >= 1, got {max_blocks_per_seq}")
        self.batch_sizes = sizes
        self.pad_seq_len = pad_seq_len
        largest = sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.full((largest,), pad_seq_len, dtype=torch.int32, device=device)
        # a graph reads the memory of whatever its step closed over (index tensors, caches): the
        # step must live as long as the graphs, or that memory is reused under them
        self.step = step
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        with capturing():  # whatever capture the platform brings: no host reads in the step
            for size in reversed(sizes):  # largest first: smaller graphs reuse its memory pool
                self.replays[size] = capture.capture(self._bound(step, size), warmup=warmup)

    def _bound(self, step: DecodeStep, size: int) -> Callable[[], torch.Tensor]:
        views = (
            self.input_ids[:size],
            self.positions[:size],
            self.slot_mapping[:size],
            self.block_tables[:size],
            self.seq_lens[:size],
        )
        return lambda: step(*views)

    def bucket(self, num_seqs: int) -> int:
        """The captured size a batch of ``num_seqs`` replays (the smallest one at least as large)."""
        at = bisect.bisect_left(self.batch_sizes, num_seqs)
        if num_seqs < 1 or at == len(self.batch_sizes):
            raise ValueError(
                f"DecodeGraphs: a batch of {num_seqs} sequences; captured sizes are {self.batch_sizes[0]}.."
                f"{self.batch_sizes[-1]}. Split the batch, or capture a larger size"
            )
        return self.batch_sizes[at]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Run the step for ``n = len(input_ids)`` sequences; returns ``n`` rows.

        The rows are a view of the captured output: read them before the next call.
        """
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"DecodeGraphs: block_tables has {width} columns but the graphs were captured with "
                f"max_blocks_per_seq={self.block_tables.shape[1]}; capture with the longest context's block count"
            )
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.block_tables[:n, :width].copy_(block_tables)  # stale columns past width: seq_lens stops reads before them
        self.seq_lens[:n].copy_(seq_lens)
        if size > n:  # padding sequences: write nothing, read nothing
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.block_tables[n:size].zero_()
            self.seq_lens[n:size].fill_(self.pad_seq_len)
        return self.replays[size]()[:n]
