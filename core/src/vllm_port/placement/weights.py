"""Weights moved once: each weight's copy on each platform that reads it, within each platform's budget.

A placed model's graphs (decode, prefill) and its LM head share one :class:`WeightStore`, so a
weight read on two platforms has one copy on each, made at placement and never during a step;
``budgets`` refuses a copy that would take a platform past its bytes before it is made.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .policy import PlacementError

__all__ = ["WeightStore"]


class WeightStore:
    """Each weight's copy on each platform, made once (``tensor.to(device)``: no copy where it already lives).

    Shared by the graphs of one model (decode, prefill, the LM head), so a weight moves once.

    :param budgets: platform -> the most bytes of weights it may hold; a move past it is refused
        before it happens (:class:`PlacementError`).
    """

    def __init__(self, budgets: Mapping[str, int] | None = None) -> None:
        self._copies: dict[tuple[int, str], torch.Tensor] = {}
        self._keep: dict[int, torch.Tensor] = {}  # the originals, so ids stay unique while copies live
        self.budgets = dict(budgets or {})
        self.bytes: dict[str, int] = {}

    def get(self, weight: torch.Tensor, platform: str, device: torch.device, name: str = "") -> torch.Tensor:
        """``weight`` (called ``name`` in messages) on ``platform`` (its device ``device``)."""
        key = (id(weight), platform)
        found = self._copies.get(key)
        if found is None:
            size = weight.nelement() * weight.element_size()
            budget = self.budgets.get(platform)
            if budget is not None and self.bytes.get(platform, 0) + size > budget:
                raise PlacementError(
                    f"platform {platform!r}: weight {name or tuple(weight.shape)} ({size:,} bytes) would bring its "
                    f"weights to {self.bytes.get(platform, 0) + size:,} bytes, over its budget of {budget:,}; "
                    "place more of the model elsewhere (e.g. a rule with part = 'mlp' on the host platform)"
                )
            found = weight.to(device)
            self._copies[key] = found
            self._keep[id(weight)] = weight
            self.bytes[platform] = self.bytes.get(platform, 0) + size
        return found

    def tensors(self) -> list[torch.Tensor]:
        """Every weight copy held, on every platform (a weight already where it runs is its own copy)."""
        return list(self._copies.values())
