"""What crosses between platforms: the transfer nodes a placed graph runs, what they record, how they are described.

A value made on one platform and read on another crosses in a ``placement.transfer`` node (a
copy, even between two platforms of one device, so a placement tested on one host moves data as
it would between devices); an in-place write away from the written value's storage is copied home
by a ``placement.write_back`` node. Both add to a :class:`TransferStats` each time they run.
Placing a graph lists each such node as a :class:`Transfer`, its size a formula of the batch
(:func:`bytes_formula`), which ``vllm-port inspect --placement`` prints.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Transfer", "TransferStats", "bytes_formula", "transfer_function", "write_back_function"]


class TransferStats:
    """Transfers run, by direction (``(src, dst)`` platform names): how many and how many bytes.

    Every ``placement.transfer`` and ``placement.write_back`` call of a placed model adds one; the
    engine's steps add up until :meth:`reset`.
    """

    def __init__(self) -> None:
        self.by_direction: dict[tuple[str, str], list[int]] = {}

    def record(self, src: str, dst: str, nbytes: int) -> None:
        """One transfer of ``nbytes`` from ``src`` to ``dst``."""
        entry = self.by_direction.get((src, dst))
        if entry is None:
            self.by_direction[(src, dst)] = [1, nbytes]
        else:
            entry[0] += 1
            entry[1] += nbytes

    @property
    def count(self) -> int:
        """Transfers run in every direction together."""
        return sum(c for c, _ in self.by_direction.values())

    @property
    def bytes(self) -> int:
        """Bytes moved in every direction together."""
        return sum(b for _, b in self.by_direction.values())

    def reset(self) -> None:
        self.by_direction.clear()

    def to_json(self) -> dict[str, dict[str, int]]:
        """``{"cpu->cuda": {"count": N, "bytes": B}, ...}``."""
        return {f"{s}->{d}": {"count": c, "bytes": b} for (s, d), (c, b) in sorted(self.by_direction.items())}


def transfer_function(devices: Mapping[str, torch.device], stats: TransferStats) -> Callable[..., torch.Tensor]:
    """The target of a graph's ``placement.transfer`` nodes: copy to ``devices[dst]``, counted in ``stats``."""

    def transfer(x: torch.Tensor, *, src: str, dst: str) -> torch.Tensor:
        stats.record(src, dst, x.nelement() * x.element_size())
        # a copy even between two platforms on one device, so that a placement tested on one host
        # moves data exactly as it would between two devices
        return x.to(devices[dst], copy=True)

    transfer.__module__, transfer.__name__, transfer.__qualname__ = "placement", "transfer", "transfer"
    return transfer


def write_back_function(stats: TransferStats) -> Callable[..., torch.Tensor]:
    """The target of a graph's ``placement.write_back`` nodes: copy the written value home, counted in ``stats``."""

    def write_back(home: torch.Tensor, written: torch.Tensor, *, src: str, dst: str) -> torch.Tensor:
        stats.record(src, dst, written.nelement() * written.element_size())
        return home.copy_(written)

    write_back.__module__, write_back.__name__, write_back.__qualname__ = "placement", "write_back", "write_back"
    return write_back


@dataclass(frozen=True)
class Transfer:
    """One transfer node of a placed graph: which value crosses, from where to where, and its size.

    Attributes:
        name: the node's name in the placed graph (``transfer_3``).
        kind: ``"transfer"`` (a copy for a reader) or ``"write_back"`` (an in-place write copied home).
        value: the value that crosses (``%linear_3``, ``block_tables``).
        producer: the node that made it, or the graph input it is.
        consumers: the nodes on ``dst`` that read the copy.
        src, dst: the platforms.
        shape: the value's shape and dtype (``[num_seqs, 128] f32``).
        bytes: its size per step as a formula of the batch (``512*num_seqs``).
        bytes_per_token: bytes per token of the step's batch, where the size is proportional to it.
    """

    name: str
    kind: str
    value: str
    producer: str
    consumers: tuple[str, ...]
    src: str
    dst: str
    shape: str
    bytes: str
    bytes_per_token: int | None

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "consumers": list(self.consumers)}


def bytes_formula(val: Any, symbol_names: Mapping[str, str], token: Any) -> tuple[str, int | None]:
    """The bytes of ``val`` as a formula of the batch (``512*num_seqs``), and per token where proportional to it."""
    if not isinstance(val, torch.Tensor):
        return "0", None
    numel: Any = val.element_size()
    for size in val.shape:
        numel = numel * (size.node.expr if isinstance(size, torch.SymInt) else int(size))
    if isinstance(numel, int):
        return str(numel), None
    text = str(numel)
    for symbol in sorted(numel.free_symbols, key=lambda s: -len(str(s))):
        text = re.sub(rf"\b{re.escape(str(symbol))}\b", symbol_names.get(str(symbol), str(symbol)), text)
    per_token = None
    if token is not None and numel.free_symbols == {token}:
        ratio = numel / token
        if ratio.is_number and float(ratio) == math.floor(float(ratio)):
            per_token = int(ratio)
    return text.replace("*", "·"), per_token
