"""FP8 checkpoints as Hugging Face writes them: ``quantization_config`` read, and each projection's scale made the op's.

Two formats, both e4m3 weights (safetensors tag ``F8_E4M3``) with float scales beside them:

- ``quant_method: "fp8"`` (transformers' FineGrainedFP8, vLLM's fp8): the scale is ``<module>.weight_scale_inv``
  (transformers; despite the name a multiplier) or ``<module>.weight_scale`` (vLLM), per tensor when
  ``weight_block_size`` is null, else one per block of ``weight_block_size = [rows, 128]`` (DeepSeek-V3's and
  Qwen3-FP8's 128 x 128). ``activation_scheme`` may be ``"dynamic"`` or ``"static"``: the ops quantise
  activations per token either way, so a static checkpoint's ``input_scale`` is not read.
- ``quant_method: "compressed-tensors"`` with ``format`` ``"float-quantized"`` or ``"naive-quantized"``: each
  ``config_groups`` entry's ``weights`` must be ``num_bits: 8``, ``type: "float"``, ``symmetric: true``, with
  ``strategy`` ``"tensor"``, ``"channel"`` or ``"block"`` (``block_structure [rows, 128]``); the scale is
  ``<module>.weight_scale``. ``input_activations`` may be dynamic or static (not read, as above).

The decoder layers' seven projections are FP8; the embedding, norms and LM head stay float (a checkpoint that
quantises the LM head is refused by the loader, naming the tensor). Every scale becomes ``fp8_linear``'s
per-channel ``[out]`` (a per-tensor scale repeated, exactly) or per-group ``[out, ceil(in / 128)]`` (a block's
scale repeated over its rows, exactly), so the model's fused q/k/v and gate/up weights concatenate their scales.
Anything else is refused with a :class:`ModelLoadError` naming the field of ``config.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError
from ..ops.fp8 import FP8_GROUP

__all__ = ["FP8_TAG", "Fp8Checkpoint", "read_quantization", "scale_for_op"]

#: The safetensors dtype tag of an e4m3 weight.
FP8_TAG = "F8_E4M3"
_FIELD = "quantization_config"


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How an FP8 checkpoint stores its projections' scales.

    Attributes:
        method: ``"fp8"`` or ``"compressed-tensors"``: the ``quant_method``.
        scale_names: the names a projection's scale may have beside its ``weight``, tried in order.
        block: ``(rows, columns)`` of a block-wise scale, or None for per-tensor or per-channel scales.
    """

    method: str
    scale_names: tuple[str, ...]
    block: tuple[int, int] | None


def read_quantization(path: Path, raw: Mapping[str, Any]) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 scheme from ``config.json``'s ``quantization_config`` (None without one).

    :raises ModelLoadError: for a quantisation the ops cannot run, naming the field and what it must be.
    """
    q = raw.get(_FIELD)
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise _fail(path, _FIELD, q, "an object")
    method = q.get("quant_method")
    if method == "fp8":
        return _fine_grained(path, q)
    if method == "compressed-tensors":
        return _compressed_tensors(path, q)
    raise _fail(
        path, f"{_FIELD}.quant_method", method, "'fp8' or 'compressed-tensors' (float8 weights); other "
        "quantisations (GPTQ, AWQ, int8, int4, bitsandbytes) are not supported: use the unquantized weights"
    )  # fmt: skip


def _fine_grained(path: Path, q: Mapping[str, Any]) -> Fp8Checkpoint:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _fail(path, f"{_FIELD}.activation_scheme", scheme, "'dynamic' or 'static'")
    fmt = q.get("scale_fmt", "float")
    if fmt != "float":
        raise _fail(path, f"{_FIELD}.scale_fmt", fmt, "'float' (float32 scales; ue8m0 exponents are not supported)")
    block = q.get("weight_block_size")
    return Fp8Checkpoint("fp8", ("weight_scale_inv", "weight_scale"), _block(path, "weight_block_size", block))


def _compressed_tensors(path: Path, q: Mapping[str, Any]) -> Fp8Checkpoint:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _fail(path, f"{_FIELD}.format", fmt, "'float-quantized' or 'naive-quantized' (float8 weights)")
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _fail(path, f"{_FIELD}.config_groups", groups, "an object of quantisation groups")
    blocks = set()
    for name, group in groups.items():
        field = f"{_FIELD}.config_groups.{name}.weights"
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise _fail(path, field, weights, "an object describing the weights' quantisation")
        for key, want, what in (
            ("num_bits", 8, "8 (float8)"),
            ("type", "float", "'float' (e4m3; integer weights are not supported)"),
            ("symmetric", True, "true (no zero points)"),
        ):
            if weights.get(key) != want:
                raise _fail(path, f"{field}.{key}", weights.get(key), what)
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _fail(path, f"{field}.strategy", strategy, "'tensor', 'channel' or 'block'")
        if strategy == "block":
            blocks.add(_block(path, f"config_groups.{name}.weights.block_structure", weights.get("block_structure")))
    if len(blocks) > 1:
        raise _fail(path, f"{_FIELD}.config_groups", sorted(blocks), "one block structure for every group")
    return Fp8Checkpoint("compressed-tensors", ("weight_scale",), blocks.pop() if blocks else None)


def _block(path: Path, field: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise _fail(path, f"{_FIELD}.{field}", value, "null or [rows, columns] of positive ints")
    if value[1] != FP8_GROUP:
        raise _fail(
            path, f"{_FIELD}.{field}", value, f"blocks of {FP8_GROUP} columns ([rows, {FP8_GROUP}], as DeepSeek-V3 "
            "and Qwen3-FP8 write): fp8_linear's grouped scales cover 128 input features each"
        )  # fmt: skip
    return (value[0], value[1])


def _fail(path: Path, field: str, value: Any, expected: str) -> ModelLoadError:
    return ModelLoadError(f"{path}: field '{field}' is {value!r}; it must be {expected}")


def scale_shapes(scheme: Fp8Checkpoint, out_features: int, in_features: int) -> list[tuple[int, ...]]:
    """The scale shapes a projection ``[out, in]`` may have in the file under ``scheme``."""
    if scheme.block is not None:
        rows, cols = scheme.block
        return [(-(-out_features // rows), -(-in_features // cols))]
    return [(), (1,), (out_features,), (out_features, 1)]


def scale_for_op(scale: torch.Tensor, scheme: Fp8Checkpoint, out_features: int) -> torch.Tensor:
    """A file's scale as ``fp8_linear`` takes it, float32: ``[out]`` (tensor or channel), or ``[out, groups]`` (blocks).

    Exact: a per-tensor scale is repeated per channel, a block's scale over the block's rows.
    """
    scale = scale.to(torch.float32)
    if scheme.block is not None:
        return scale.repeat_interleave(scheme.block[0], dim=0)[:out_features].contiguous()
    return scale.reshape(-1).expand(out_features).contiguous() if scale.numel() == 1 else scale.reshape(-1)
