"""Smoke checks: a candidate provider run on its op's smallest samples, before it is bound.

``runtime.bind(dtype, verify=True)`` (and ``vllm-port doctor``, always) smoke-checks the candidates
of each op best first: one that raises, returns the wrong shape, dtype or device, or wrong values
is skipped for the next, with the reason in ``BoundOps.skipped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._op import Op, SampleInput

if TYPE_CHECKING:
    from ._provider import Provider

__all__ = ["SMOKE_SAMPLES", "smoke_check", "smoke_samples"]

#: Samples of each op a smoke check runs (the op's smallest: milliseconds each on a CPU).
SMOKE_SAMPLES = 2

_SAMPLES: dict[tuple[str, torch.dtype, str], tuple[SampleInput, ...]] = {}


def smoke_samples(op: Op, dtype: torch.dtype, device: torch.device) -> tuple[SampleInput, ...]:
    """``op``'s first :data:`SMOKE_SAMPLES` samples for ``dtype`` on ``device``, made once per process."""
    key = (op.name, dtype, str(device))
    if key not in _SAMPLES:  # making an op's samples takes up to a few hundred ms: once per process
        _SAMPLES[key] = tuple(op.samples(dtype, device, torch.Generator().manual_seed(0))[:SMOKE_SAMPLES])
    return _SAMPLES[key]


def _on_inputs_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, refusing outputs on another device than its inputs' (``Op.check`` compares values only)."""

    def call(*args: Any) -> Any:
        out = fn(*args)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if isinstance(out, torch.Tensor) and device is not None and out.device != device:
            raise _WrongDeviceError(f"returned a tensor on {out.device}, but the inputs are on {device}")
        return out

    return call


class _WrongDeviceError(Exception):
    pass


def smoke_check(op: Op, provider: Provider, dtype: torch.dtype, device: torch.device) -> str | None:
    """Run ``provider`` on ``op``'s smallest samples against the float64 reference; ``None`` when it passes.

    Otherwise says what is wrong on which sample: an exception, a wrong shape, dtype or device,
    values outside the tolerance, writes where the op only reads.
    """
    for sample in smoke_samples(op, dtype, device):
        try:
            problem = op.check(_on_inputs_device(provider.fn), sample.args, dtype)
        except _WrongDeviceError as exc:
            problem = str(exc)
        except Exception as exc:  # a smoke check reports; it never takes binding down
            problem = f"raised {type(exc).__name__}: {exc}"
        if problem:
            _SAMPLES.pop((op.name, dtype, str(device)), None)  # it may have written into the samples
            return f"on sample {sample.label!r}: {problem}"
    return None
