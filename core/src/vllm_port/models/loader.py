"""Weights from a local Hugging Face directory: safetensors only, checked first, then streamed to the device.

Loading runs in two passes. The first reads only the safetensors headers (names, shapes, dtypes)
and checks that every tensor the config implies is there with the right shape and a float dtype;
any problem is a :class:`ModelLoadError` raised before one byte of weights moves. The second pass
opens one shard at a time and moves its tensors one by one to the device in the target dtype, so
host memory holds one tensor, never the model (the file itself is memory-mapped, not read whole).
Each tensor is checked for NaN and Inf where it lands (one ``aminmax`` pass, about as fast as a
copy; the flags of one shard are read in one host synchronisation): a model with them generates
garbage that looks like an answer, so such a tensor is refused, naming it and its file.
``VLLM_PORT_CHECK_WEIGHTS=0`` skips the pass.

Trust: a checkpoint is data from elsewhere, so nothing in it runs and nothing it names leaves the
directory. Pickled checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are never opened: unpickling
runs arbitrary code; they are refused, naming the files and how to convert them. The shard index
may name only ``.safetensors`` files inside the model directory (:func:`~.config.model_file`: no
absolute paths, no ``..``, no symlink out). :func:`check_fits` holds what config.json implies to the
memory there is, before anything is allocated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelLoadError
from ..faults import read_switch
from ..ops import FLOAT_DTYPES
from .config import ModelConfig, check_regular_file, model_file, read_json
from .quantization import FP8_TAG, scale_for_op, scale_shapes

__all__ = [
    "CHECK_WEIGHTS_ENV",
    "WeightSpec",
    "check_fits",
    "checking_weights",
    "expected_weights",
    "expert_weight_names",
    "fp8_weights",
    "load_weights",
]

#: ``VLLM_PORT_CHECK_WEIGHTS=0`` loads weights without looking for NaN and Inf in them (on by default).
CHECK_WEIGHTS_ENV = "VLLM_PORT_CHECK_WEIGHTS"

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")
#: A safetensors header: tensor name -> (shape, dtype tag).
_Header = dict[str, tuple[tuple[int, ...], str]]
#: safetensors dtype tags of floating-point tensors; anything else (I8, U8, F8_*) is a quantized checkpoint.
_FLOAT_TAGS = ("F64", "F32", "BF16", "F16")


@dataclass(frozen=True)
class WeightSpec:
    """One tensor the model needs: its shape, and how the config implies it (for error messages)."""

    shape: tuple[int, ...]
    why: str


def expected_weights(config: ModelConfig) -> dict[str, WeightSpec]:
    """Every tensor the flat model reads, by Hugging Face name, with the shape ``config`` implies."""
    c = config
    hidden = f"hidden_size={c.hidden_size}"
    q = f"num_attention_heads={c.num_heads} * head_dim={c.head_size}"
    kv = f"num_key_value_heads={c.num_kv_heads} * head_dim={c.head_size}"
    mlp = f"intermediate_size={c.intermediate_size}"
    specs = {"model.embed_tokens.weight": WeightSpec((c.vocab_size, c.hidden_size), f"[vocab_size, {hidden}]")}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = WeightSpec((c.hidden_size,), f"[{hidden}]")
        specs[p + "self_attn.q_proj.weight"] = WeightSpec((c.q_size, c.hidden_size), f"[{q}, {hidden}]")
        specs[p + "self_attn.k_proj.weight"] = WeightSpec((c.kv_size, c.hidden_size), f"[{kv}, {hidden}]")
        specs[p + "self_attn.v_proj.weight"] = WeightSpec((c.kv_size, c.hidden_size), f"[{kv}, {hidden}]")
        if c.attention_bias:
            specs[p + "self_attn.q_proj.bias"] = WeightSpec((c.q_size,), f"[{q}]")
            specs[p + "self_attn.k_proj.bias"] = WeightSpec((c.kv_size,), f"[{kv}]")
            specs[p + "self_attn.v_proj.bias"] = WeightSpec((c.kv_size,), f"[{kv}]")
        specs[p + "self_attn.o_proj.weight"] = WeightSpec((c.hidden_size, c.q_size), f"[{hidden}, {q}]")
        if c.o_proj_bias:
            specs[p + "self_attn.o_proj.bias"] = WeightSpec((c.hidden_size,), f"[{hidden}]")
        if c.qk_norm:
            specs[p + "self_attn.q_norm.weight"] = WeightSpec((c.head_size,), f"[head_dim={c.head_size}]")
            specs[p + "self_attn.k_norm.weight"] = WeightSpec((c.head_size,), f"[head_dim={c.head_size}]")
        specs[p + "post_attention_layernorm.weight"] = WeightSpec((c.hidden_size,), f"[{hidden}]")
        if c.moe is not None and c.moe.sparse_layers[i]:
            specs.update(_expert_specs(c, i))
            continue
        specs[p + "mlp.gate_proj.weight"] = WeightSpec((c.intermediate_size, c.hidden_size), f"[{mlp}, {hidden}]")
        specs[p + "mlp.up_proj.weight"] = WeightSpec((c.intermediate_size, c.hidden_size), f"[{mlp}, {hidden}]")
        specs[p + "mlp.down_proj.weight"] = WeightSpec((c.hidden_size, c.intermediate_size), f"[{hidden}, {mlp}]")
    specs["model.norm.weight"] = WeightSpec((c.hidden_size,), f"[{hidden}]")
    if not c.tie_word_embeddings:
        specs["lm_head.weight"] = WeightSpec((c.vocab_size, c.hidden_size), f"[vocab_size, {hidden}]")
    return specs


#: Each expert's (gate, up, down) names and the router's, by architecture, as Hugging Face writes them.
_EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp.gate", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
}


def expert_weight_names(config: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """A MoE layer's router weight name and each expert's ``(gate, up, down)`` weight names."""
    router, expert, (gate, up, down) = _EXPERT_NAMES[config.architecture]
    p = f"model.layers.{layer}."
    experts = [
        tuple(p + expert.format(e=e) + part + ".weight" for part in (gate, up, down))
        for e in range(config.moe.num_experts)
    ]
    return p + router + ".weight", experts


def _expert_specs(c: ModelConfig, layer: int) -> dict[str, WeightSpec]:
    m = c.moe
    hidden, width = f"hidden_size={c.hidden_size}", f"expert intermediate size {m.intermediate_size}"
    router, experts = expert_weight_names(c, layer)
    specs = {router: WeightSpec((m.num_experts, c.hidden_size), f"[num_experts={m.num_experts}, {hidden}]")}
    for gate, up, down in experts:
        specs[gate] = WeightSpec((m.intermediate_size, c.hidden_size), f"[{width}, {hidden}]")
        specs[up] = WeightSpec((m.intermediate_size, c.hidden_size), f"[{width}, {hidden}]")
        specs[down] = WeightSpec((c.hidden_size, m.intermediate_size), f"[{hidden}, {width}]")
    return specs


def check_dtype(dtype: torch.dtype) -> None:
    """Refuse a target dtype the contract ops do not run (they are defined for float32, bfloat16, float16)."""
    if dtype not in FLOAT_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in FLOAT_DTYPES))
        raise ModelLoadError(
            f"dtype {dtype} cannot run: the ops every platform binds are defined for {names}; load in one of them"
        )


def _checkpoint_files(model_dir: Path) -> dict[str, Path] | list[Path]:
    """The index's tensor -> file map when the checkpoint is sharded with an index, else its safetensors files."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory; pass a Hugging Face model directory")
    index = model_file(model_dir, _INDEX)
    if index.exists():
        weight_map = read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelLoadError(f"{index}: field 'weight_map' must map tensor names to shard file names")
        files: dict[str, Path] = {}
        field = f"{_INDEX} field 'weight_map'"
        for shard in sorted(set(weight_map.values())):  # each file checked once, however many tensors it holds
            path = model_file(model_dir, shard, named_by=field)
            if not shard.endswith(".safetensors"):
                _refuse_pickled(model_dir, f"{field} names {shard!r}, which is not a .safetensors file")
            files[shard] = path
        return {name: files[file] for name, file in weight_map.items()}
    if (model_dir / _SINGLE).exists():
        return [model_file(model_dir, _SINGLE)]
    found = [model_file(model_dir, p.name) for p in sorted(model_dir.glob("*.safetensors"))]
    if found:
        return found
    pickled = sorted(p.name for pattern in _PICKLED for p in model_dir.glob(pattern))
    if pickled:
        _refuse_pickled(model_dir, f"only pickled checkpoints ({', '.join(pickled)})")
    raise ModelLoadError(
        f"{model_dir}: no weights: expected {_SINGLE}, or shards with {_INDEX}; the directory holds "
        f"{', '.join(sorted(p.name for p in model_dir.iterdir())) or 'nothing'}"
    )


def _refuse_pickled(model_dir: Path, what: str) -> NoReturn:
    raise ModelLoadError(
        f"{model_dir}: {what}, which vllm-port never loads (unpickling runs arbitrary code). Convert the "
        "checkpoint to safetensors once, on a machine where you trust the files: "
        'python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{model_dir}').save_pretrained('OUT_DIR')\" (writes safetensors), then load OUT_DIR"
    )


def check_fits(
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    device_free: int | None,
    host_free: int,
    num_shards: int = 1,
    where: str = "the device",
    config_path: str | os.PathLike[str] = "config.json",
) -> None:
    """Refuse a model whose weights cannot fit, from config.json's sizes alone, before anything is allocated.

    The device must hold the weights in ``dtype`` (split over ``num_shards`` devices with tensor
    parallelism: a lower bound per device, so nothing that fits is refused) and the rotary table;
    the host must hold the largest tensor twice while loading converts it (as read, then in ``dtype``).
    ``device_free=None`` checks the host only (the caller cannot ask the device without side effects).

    :raises ModelLoadError: naming config.json, the sizes that make up the bytes, the bytes and the memory free.
    """
    c = config
    sizes = (
        f"vocab_size={c.vocab_size:,}, hidden_size={c.hidden_size:,}, intermediate_size={c.intermediate_size:,}, "
        f"num_hidden_layers={c.num_layers:,}, max_position_embeddings={c.max_position_embeddings:,}"
    )
    per_device = -(-c.weight_bytes(dtype) // num_shards)
    if device_free is not None and per_device > device_free:
        split = f" per device over {num_shards} devices" if num_shards > 1 else ""
        raise ModelLoadError(
            f"{config_path}: the weights take {_gib(per_device)}{split} in {str(dtype).removeprefix('torch.')} "
            f"({c.num_parameters:,} parameters from {sizes}), more than the {_gib(device_free)} free on {where}; "
            "load a smaller dtype, shard it over more devices (tensor_parallel_size), or pick a smaller model"
        )
    staging = c.largest_tensor_numel * (c.dtype.itemsize + dtype.itemsize)
    if staging > host_free:
        raise ModelLoadError(
            f"{config_path}: loading stages its largest tensor ({c.largest_tensor_numel:,} elements, from {sizes}) "
            f"in {_gib(staging)} of host memory, more than the {_gib(host_free)} available; free host memory "
            "or pick a smaller model"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"


def _read_header(path: Path) -> _Header:
    """Name -> (shape, dtype tag) of every tensor in one safetensors file, reading only its header."""
    check_regular_file(path, "a safetensors weight file")  # a FIFO would hang the reader, a device never end
    if not path.is_file():
        raise ModelLoadError(f"{path}: the weight file is missing; re-download the checkpoint")
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}
            return {name: (tuple(s.get_shape()), s.get_dtype()) for name, s in slices.items()}
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(
            f"{path}: not a readable safetensors file, corrupt or truncated ({exc}); re-download or re-save it"
        ) from exc


def _locate(model_dir: Path, needed: Collection[str]) -> tuple[dict[Path, list[str]], dict[Path, _Header]]:
    """File -> the needed tensors it holds, and every read header; a needed tensor found nowhere is an error."""
    files = _checkpoint_files(model_dir)
    headers: dict[Path, _Header] = {}
    where: dict[str, Path] = {}
    if isinstance(files, dict):  # sharded with an index: the index says where, the shard's header what
        unindexed = [name for name in needed if name not in files]
        _refuse_missing(model_dir, unindexed, f"the index {_INDEX}")
        for name in needed:
            where[name] = files[name]
        for path in sorted(set(where.values())):
            headers[path] = _read_header(path)
            absent = [name for name in needed if where[name] == path and name not in headers[path]]
            _refuse_missing(model_dir, absent, f"{path.name}, where {_INDEX} places them")
    else:
        for path in files:
            headers[path] = _read_header(path)
            for name in headers[path]:
                where.setdefault(name, path)
        _refuse_missing(model_dir, [name for name in needed if name not in where], ", ".join(p.name for p in files))
    by_file: dict[Path, list[str]] = {path: [] for path in sorted(set(where[name] for name in needed))}
    for name in needed:
        by_file[where[name]].append(name)
    return by_file, headers


def _refuse_missing(model_dir: Path, missing: list[str], searched: str) -> None:
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(
            f"{model_dir}: tensor(s) {shown} missing from {searched}; config.json implies them: the checkpoint "
            "is incomplete or of another model"
        )


def _check_tensors(
    by_file: dict[Path, list[str]], headers: dict[Path, _Header], specs: dict[str, WeightSpec], fp8: frozenset[str]
) -> None:
    for path, names in by_file.items():
        for name in names:
            shape, tag = headers[path][name]
            if (tag == FP8_TAG) != (name in fp8):
                want = f"{FP8_TAG} (quantization_config makes it float8)" if name in fp8 else "a float (F32, BF16, F16)"
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has dtype {tag}; expected {want}: vllm-port runs the decoder layers' "
                    "seven projections in float8 and everything else (embedding, norms, LM head) in float"
                )
            if shape != specs[name].shape:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has shape {list(shape)}, but config.json implies "
                    f"{list(specs[name].shape)} ({specs[name].why}); the weights and config.json disagree"
                )
            if tag not in _FLOAT_TAGS and name not in fp8:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has dtype {tag}; expected a float (F32, BF16, F16): quantized "
                    "checkpoints are not supported"
                )


def _to_target(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Move one tensor to where the model runs (the only place device memory is taken)."""
    return tensor.to(device=device, dtype=dtype)


def checking_weights() -> bool:
    """Whether loading looks for NaN and Inf in the weights (``VLLM_PORT_CHECK_WEIGHTS``, default on).

    :raises SelectionError: for a value that is not a switch.
    """
    return read_switch(CHECK_WEIGHTS_ENV, default=True)


def _all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the tensor's device: no NaN and no Inf in it (min and max propagate NaN; no copy is made)."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    if tensor.dtype == torch.float8_e4m3fn:  # no infinities; NaN is every byte with all exponent and mantissa bits
        return ~((tensor.view(torch.uint8) & 0x7F) == 0x7F).any()
    low, high = torch.aminmax(tensor)
    return low.isfinite() & high.isfinite()


def _refuse_non_finite(path: Path, name: str, loaded: torch.Tensor, tag: str) -> NoReturn:
    """Say what is not finite in ``loaded`` (tensor ``name`` of ``path``): in the file, or from the conversion."""
    if loaded.dtype == torch.float8_e4m3fn:
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({tag}) holds NaN; a model with them generates garbage. Re-download or "
            f"re-quantise the checkpoint; {CHECK_WEIGHTS_ENV}=0 loads it anyway"
        )
    nan, inf = loaded.isnan(), loaded.isinf()
    index = tuple(int(i) for i in (nan | inf).nonzero()[0])
    counts = f"{int(nan.sum()):,} NaN and {int(inf.sum()):,} infinite value(s) of {loaded.numel():,}"
    with safe_open(str(path), framework="pt") as f:
        stored = f.get_tensor(name)
    if bool(_all_finite(stored)):  # finite in the file: converting to a narrower dtype overflowed
        biggest = float(stored.abs().max())
        limit = torch.finfo(loaded.dtype).max
        raise ModelLoadError(
            f"{path}: tensor {name!r} is finite in the file ({tag}), but {counts} overflow "
            f"{str(loaded.dtype).removeprefix('torch.')} (its largest magnitude is {biggest:.4g}, the dtype holds at most "
            f"{limit:.4g}; first at index {index}); load in a wider dtype (dtype='float32' or 'bfloat16')"
        )
    raise ModelLoadError(
        f"{path}: tensor {name!r} holds {counts} (first at index {index}, {float(loaded[index])}); a model with them "
        f"generates garbage. Re-download or re-save the checkpoint; {CHECK_WEIGHTS_ENV}=0 loads it anyway"
    )


def load_weights(
    model_dir: str | os.PathLike[str],
    config: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor the model needs, by Hugging Face name, on ``device`` in ``dtype``.

    ``keep``: read only the tensors whose names it accepts (a pipeline stage's); every header is
    checked all the same.

    Headers are checked before any weight moves; then shards are opened one at a time and their
    tensors moved one by one, so peak host memory is about one tensor. Tensors the model does not
    read (``rotary_emb.inv_freq`` of old checkpoints, a tied ``lm_head``) are skipped.

    :raises ModelLoadError: for a dtype the ops do not run, pickled-only or missing weights, a
        missing, corrupt or truncated file, a missing tensor, a shape that disagrees with the config,
        a non-float tensor, or (unless ``VLLM_PORT_CHECK_WEIGHTS=0``) a tensor holding NaN or Inf
        in the target dtype; the message names the file and the tensor.
    """
    check_dtype(dtype)
    check = checking_weights()
    device = torch.device(device)
    specs = expected_weights(config)
    by_file, headers = _locate(Path(model_dir), specs)
    fp8 = fp8_weights(config)
    scales = _locate_scales(config, fp8, by_file, headers, specs)
    _check_tensors(by_file, headers, specs, fp8)
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        names = names if keep is None else [n for n in names if keep(n)]
        if not names:
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    if name in fp8:  # kept in e4m3, its scale made fp8_linear's
                        weights[name] = tensor.to(device)
                        stored = f.get_tensor(scales[name])
                        weights[name + "_scale"] = _scale(config, path, scales[name], stored, specs[name]).to(device)
                    else:
                        weights[name] = _to_target(tensor, device, dtype)
        except (SafetensorError, OSError) as exc:  # the file changed or broke after its header was read
            raise ModelLoadError(f"{path}: reading its tensors failed ({exc}); re-download or re-save it") from exc
        if check:
            _check_finite(path, names, weights, headers[path])
    return {name: weights[name] for name in (*specs, *(n + "_scale" for n in fp8)) if keep is None or name in weights}


def fp8_weights(config: ModelConfig) -> frozenset[str]:
    """The projections an FP8 checkpoint stores in e4m3 (every decoder layer's seven); empty for a float one."""
    if config.quantization is None:
        return frozenset()
    projections = [f"self_attn.{x}_proj" for x in "qkvo"] + [f"mlp.{x}_proj" for x in ("gate", "up", "down")]
    return frozenset(f"model.layers.{i}.{p}.weight" for i in range(config.num_layers) for p in projections)


def _locate_scales(
    config: ModelConfig, fp8: frozenset[str], by_file: dict[Path, list[str]], headers: dict[Path, _Header],
    specs: dict[str, WeightSpec],
) -> dict[str, str]:  # fmt: skip
    """Each FP8 weight's scale tensor, in its weight's file, with a shape the scheme allows (else refused)."""
    found: dict[str, str] = {}
    scheme = config.quantization
    for path, names in by_file.items():
        for name in (n for n in names if n in fp8):
            module = name.removesuffix("weight")
            scale = next((module + s for s in scheme.scale_names if module + s in headers[path]), None)
            if scale is None:
                tried = " or ".join(repr(module + s) for s in scheme.scale_names)
                raise ModelLoadError(
                    f"{path}: tensor {tried} is missing; config.json's quantization_config ({scheme.method}) stores "
                    f"{name!r} in float8 with its scale beside it in the same file"
                )
            shape, tag = headers[path][scale]
            allowed = scale_shapes(scheme, *specs[name].shape)
            if shape not in allowed or tag not in _FLOAT_TAGS:
                raise ModelLoadError(
                    f"{path}: tensor {scale!r} is {tag} {list(shape)}; for a weight of {list(specs[name].shape)} under "
                    f"config.json's quantization_config (block {scheme.block}) it must be a float tensor of shape "
                    + " or ".join(str(list(s)) for s in allowed)
                )
            found[name] = scale
    return found


def _scale(config: ModelConfig, path: Path, name: str, stored: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """``stored`` as fp8_linear's float32 scale, refused when a value is not finite and > 0."""
    scale = scale_for_op(stored, config.quantization, spec.shape[0])
    if not bool((scale.isfinite() & (scale > 0)).all()):
        raise ModelLoadError(
            f"{path}: tensor {name!r} holds a scale that is not finite and > 0 ({float(scale.min()):g} to "
            f"{float(scale.max()):g}); re-download or re-quantise the checkpoint"
        )
    return scale


def _check_finite(path: Path, names: list[str], weights: dict[str, torch.Tensor], header: _Header) -> None:
    """Refuse the first of ``path``'s loaded tensors that holds NaN or Inf: one host read for the whole shard."""
    if not names:
        return
    flags = torch.stack([_all_finite(weights[name]) for name in names]).tolist()  # float8: no NaN byte
    for name, finite in zip(names, flags, strict=True):
        if not finite:
            _refuse_non_finite(path, name, weights[name], header[name][1])
