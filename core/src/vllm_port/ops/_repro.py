"""Reproducers: a failing call's inputs, safetensors for the tensors and JSON for the rest.

Debug mode writes one on each fault (:func:`write_repro`); ``vllm-port check-repro FILE``
(:mod:`vllm_port.replay_command`) rebuilds the arguments (:func:`load_repro`), views with their
strides and offsets, and replays the call. Nothing is unpickled to replay one.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SelectionError
from ._op import Op

if TYPE_CHECKING:
    from ._provider import Provider

__all__ = ["REPRO_FORMAT", "load_repro", "write_repro"]

REPRO_FORMAT = "vllm-port-check-repro/1"

_repro_counter = itertools.count()


def _arg_json(value: Any, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        name = f"arg{index}"
        tensors[name] = value.detach().to("cpu").contiguous()
        return {
            "tensor": name,
            "shape": list(value.shape),
            "stride": list(value.stride()),
            "storage_offset": value.storage_offset(),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return {"value": value}
    if isinstance(value, float):
        return {"float": repr(value)}  # repr round-trips exactly, nan and inf included
    return {"repr": repr(value)}


def write_repro(directory: Path, op: Op, chosen: Provider, context: Any, inputs: tuple[Any, ...], problem: str) -> Path:
    """Write ``inputs`` of a failing call as ``<op>-<provider>-<pid>-<n>.json`` + ``.safetensors``; return the JSON's path."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{op.name}-{chosen.name}-{os.getpid()}-{next(_repro_counter)}"
    tensors: dict[str, torch.Tensor] = {}
    args = [_arg_json(a, i, tensors) for i, a in enumerate(inputs)]
    save_file(tensors, str(directory / f"{stem}.safetensors"))
    path = directory / f"{stem}.json"
    record = {
        "format": REPRO_FORMAT,
        "op": op.name,
        "provider": chosen.name,
        "plugin": chosen.plugin,
        "platform": context.platform,
        "device_type": context.device_type,
        "dtype": str(context.dtype).removeprefix("torch."),
        "problem": problem,
        "args": args,
        "tensors": f"{stem}.safetensors",
        "command": f"vllm-port check-repro {path}",
    }
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def _rebuild(spec: dict[str, Any], tensors: Mapping[str, torch.Tensor], device: torch.device) -> Any:
    if "tensor" in spec:
        data = tensors[spec["tensor"]].to(device)
        shape, stride, offset = spec["shape"], spec["stride"], spec["storage_offset"]
        overlapping = any(st == 0 and n > 1 for n, st in zip(shape, stride, strict=True))
        if overlapping or 0 in shape:
            return data.expand(shape) if overlapping else data
        size = offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1
        fill = math.nan if data.is_floating_point() else 0  # poison around the view: a read outside shows
        storage = torch.full((size,), fill, dtype=data.dtype, device=device)
        view = storage.as_strided(shape, stride, offset)
        view.copy_(data)
        return view
    if "float" in spec:
        return float(spec["float"])
    if "repr" in spec:
        raise SelectionError(f"reproducer argument {spec['repr']} cannot be rebuilt from JSON")
    return spec["value"]


def load_repro(path: str | os.PathLike[str], device: torch.device) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The record and the rebuilt arguments (views keep their strides and offsets) of a reproducer."""
    from safetensors.torch import load_file

    path = Path(path)
    record = json.loads(path.read_text(encoding="utf-8"))
    if record.get("format") != REPRO_FORMAT:
        raise SelectionError(
            f"{path}: not a vllm-port reproducer (format {record.get('format')!r}, want {REPRO_FORMAT!r})"
        )
    tensors = load_file(str(path.parent / record["tensors"]))
    return record, tuple(_rebuild(spec, tensors, device) for spec in record["args"])
