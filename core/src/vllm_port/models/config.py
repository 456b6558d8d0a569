"""A model's ``config.json``, as Hugging Face writes it, read into one checked :class:`ModelConfig`.

Both spellings transformers has used are read: ``rope_theta`` + ``rope_scaling`` with ``torch_dtype``
(4.x), and ``rope_parameters`` with ``dtype`` (5.x). Every field is type-checked; a missing or
wrong one, an architecture or rope scaling this package does not run, is a :class:`ModelLoadError`
naming the file, the field and what was expected.

A config is data from elsewhere, read before anything is allocated: every size has an upper bound
(:data:`SIZE_LIMITS`, far above any released model), so an absurd one is refused here with its
field's name rather than met as an out-of-memory crash, and :meth:`ModelConfig.weight_bytes` says
what the weights will take before they are loaded. Files are read only inside the model directory
(:func:`model_file`).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from types import MappingProxyType
from typing import Any

import torch

from ..errors import ModelLoadError
from .quantization import Fp8Checkpoint, read_quantization

__all__ = [
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_JSON_INT_DIGITS",
    "ROPE_TYPES",
    "SIZE_LIMITS",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "MoeConfig",
    "check_regular_file",
    "load_config",
    "model_file",
    "read_json",
    "read_model_file",
    "read_sampling_defaults",
    "refuse_hub_id",
]

#: The ``architectures`` one flat definition (:class:`~vllm_port.models.llama.LlamaModel`) serves.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
#: The architectures whose attention normalises each query and key head (Qwen3's ``q_norm``/``k_norm``).
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
#: What transformers' config class of an architecture assumes where config.json leaves a field out (read
#: from transformers 5.25's classes; core/tests/models/test_model_config.py compares them with the installed
#: transformers): Mixtral's rope_theta and rms_norm_eps, Mistral's sliding window. Elsewhere 10000 and 1e-6.
ARCHITECTURE_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "MixtralForCausalLM": MappingProxyType({"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5}),
        "MistralForCausalLM": MappingProxyType({"sliding_window": 4096}),
    }
)
#: The mixture-of-experts architectures (their MoE blocks run through the ``fused_moe`` op).
_MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
#: The rope types understood: plain RoPE and Llama 3.1's frequency-dependent scaling.
ROPE_TYPES = ("default", "llama3")
_REQUIRED = object()  # marks a field without a default
#: The largest value each size field of config.json may hold. Each is many times the largest
#: released model's (vocabularies reach ~262k, hidden sizes ~25k, MLPs ~110k, depths ~130 layers,
#: contexts 10M): past them the file is not a model but a mistake or an attack, refused before any
#: structure is sized by it. The sizes together are then held to memory (``ModelConfig.weight_bytes``).
SIZE_LIMITS: Mapping[str, int] = MappingProxyType(
    {
        "vocab_size": 1 << 24,
        "hidden_size": 1 << 20,
        "intermediate_size": 1 << 22,
        "num_hidden_layers": 1 << 12,
        "num_attention_heads": 1 << 12,
        "num_key_value_heads": 1 << 12,
        "head_dim": 1 << 12,
        "max_position_embeddings": 1 << 26,
        "original_max_position_embeddings": 1 << 26,
        "sliding_window": 1 << 26,
        "max_window_layers": 1 << 12,
        "bos_token_id": 1 << 24,
        "num_experts": 1 << 14,
        "num_local_experts": 1 << 14,
        "num_experts_per_tok": 1 << 14,
        "moe_intermediate_size": 1 << 22,
        "decoder_sparse_step": 1 << 12,
    }
)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's experts, as the ``fused_moe`` op takes them.

    Attributes:
        num_experts: routed experts per MoE layer (Qwen3-MoE's ``num_experts``, Mixtral's ``num_local_experts``).
        top_k: experts per token (``num_experts_per_tok``).
        intermediate_size: each expert's MLP width (Qwen3-MoE's ``moe_intermediate_size``, Mixtral's
            ``intermediate_size``).
        renormalize: the top-k weights are divided by their sum (Qwen3-MoE's ``norm_topk_prob``; always for Mixtral).
        sparse_layers: per layer, True where the MLP is a MoE block (Qwen3-MoE's ``decoder_sparse_step``
            and ``mlp_only_layers`` leave some layers dense).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[bool, ...]


@dataclass(frozen=True)
class ModelConfig:
    """What the flat Llama-family model needs to know about a checkpoint.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES`.
        head_size: ``head_dim`` from the config, else ``hidden_size // num_heads``.
        rope_scaling: ``None`` for plain RoPE, else the scaling parameters with ``"rope_type"`` set
            (``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``); read-only.
        attention_bias: q/k/v projections carry a bias (always for Qwen2; Llama's ``attention_bias``,
            which also gives ``o_proj`` one, see :attr:`o_proj_bias`).
        sliding_window: keys a query may see at most (Mistral's window); 0 = the whole context.
        dtype: the checkpoint's dtype (``torch_dtype``/``dtype``), not necessarily the one it runs in.
        eos_token_ids: end-of-sequence ids of ``config.json`` and ``generation_config.json``, in that order.
        qk_norm: each query and key head is RMS-normalised before the rotary embedding (Qwen3): one
            ``rms_norm`` call over ``[tokens, heads, head_size]`` with a ``[head_size]`` weight.
        moe: the experts of a mixture-of-experts model (None for a dense one).
        quantization: how an FP8 checkpoint stores its projections (``quantization_config``), None for float weights.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int
    dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    moe: MoeConfig | None = None
    quantization: Fp8Checkpoint | None = None

    @property
    def q_size(self) -> int:
        """Width of the query projection: ``num_heads * head_size``."""
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size

    @property
    def o_proj_bias(self) -> bool:
        """Whether ``o_proj`` has a bias: Llama's and Qwen3's ``attention_bias`` cover it, Qwen2's biases stop at q/k/v."""
        return self.attention_bias and self.architecture != "Qwen2ForCausalLM"

    @property
    def num_parameters(self) -> int:
        """Parameters of the weights the model reads (every tensor of ``expected_weights``), from the sizes alone."""
        h, q, kv, mlp = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        per_layer = 2 * h + (q + 2 * kv) * h + q * h + 3 * mlp * h
        per_layer += (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + 2 * self.head_size * self.qk_norm
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        total = embeddings + self.num_layers * per_layer + h
        if self.moe is not None:  # a MoE layer has a router and its experts in place of the dense MLP
            m = self.moe
            total += sum(m.sparse_layers) * (
                m.num_experts * h + m.num_experts * 3 * m.intermediate_size * h - 3 * mlp * h
            )
        return total

    @property
    def largest_tensor_numel(self) -> int:
        """Elements of the largest single weight (what loading holds on the host at once)."""
        h = self.hidden_size
        return max(self.vocab_size * h, self.intermediate_size * h, (self.q_size + 2 * self.kv_size) * h)

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes the loaded model takes on its device in ``dtype``: the weights and the float32 rotary table."""
        rope_table = self.max_position_embeddings * self.head_size * 4
        return self.num_parameters * dtype.itemsize + rope_table


class _Fields:
    """Typed reads of one JSON object, each failure a ``ModelLoadError`` naming the file and the field."""

    def __init__(self, path: Path, raw: Mapping[str, Any], prefix: str = "") -> None:
        self.path, self.raw, self.prefix = path, raw, prefix

    def fail(self, name: str, expected: str) -> ModelLoadError:
        if name not in self.raw:
            return ModelLoadError(f"{self.path}: field '{self.prefix}{name}' is missing; expected {expected}")
        value = self.raw[name]
        return ModelLoadError(
            f"{self.path}: field '{self.prefix}{name}' is {value!r} ({type(value).__name__}); expected {expected}"
        )

    def get_int(self, name: str, default: Any = _REQUIRED, minimum: int = 1) -> Any:
        """The field as an int in [``minimum``, its :data:`SIZE_LIMITS` bound]; absent or null gives ``default``.

        ``default`` may be ``None``; without one, an absent field fails.
        """
        value = self.raw.get(name)
        if value is None and default is not _REQUIRED:
            return default
        if value is None or isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.fail(name, f"an int >= {minimum}")
        limit = SIZE_LIMITS.get(name)
        if limit is not None and value > limit:
            raise self.fail(
                name, f"an int in [{minimum}, {limit:,}]: no model is that large; the file is damaged or not a config"
            )
        return value

    def get_float(self, name: str, default: float | None = None) -> float:
        """The field as a positive finite float; absent gives ``default``, or fails without one."""
        value = self.raw.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.fail(name, "a positive finite number")
        return float(value)

    def get_bool(self, name: str, default: bool) -> bool:
        value = self.raw.get(name, default)
        if not isinstance(value, bool):
            raise self.fail(name, "true or false")
        return value

    def get_str(self, name: str, default: str) -> str:
        value = self.raw.get(name, default)
        if not isinstance(value, str):
            raise self.fail(name, "a string")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self.raw.get(name)
        values = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise self.fail(name, "a token id (int >= 0), a list of them, or null")
        return tuple(values)


def model_file(model_dir: str | os.PathLike[str], name: object, named_by: str = "") -> Path:
    """The path of file ``name`` of a model directory, refusing one that would read outside it.

    ``name`` comes from the directory's own files (an index's ``weight_map``), so it may be
    anything: it must be a relative path without ``..``, and when the file is a symlink it must
    point inside the directory, or, in a Hugging Face hub cache (``.../snapshots/REV/`` whose files
    link to ``.../blobs/``), into that cache's ``blobs``. The file need not exist (the caller says
    what is missing).

    :param named_by: who named the file (e.g. ``"model.safetensors.index.json field 'weight_map'"``),
        for the message.
    :raises ModelLoadError: naming the file, who named it, and where it points.
    """
    root = Path(model_dir)
    who = f" ({named_by})" if named_by else ""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelLoadError(f"{root}: file name {name!r}{who} is not a file name")
    relative = PurePosixPath(name.replace("\\", "/"))
    if relative.is_absolute() or PureWindowsPath(name).drive or ".." in relative.parts:
        raise ModelLoadError(
            f"{root}: file {name!r}{who} lies outside the model directory (absolute or through '..'); "
            "a model directory names only files inside it: fix the entry or re-save the checkpoint"
        )
    path = root / relative
    target = path.resolve()  # through every symlink on the way, the file's own included
    if not any(target.is_relative_to(allowed) for allowed in _allowed_roots(root)):
        raise ModelLoadError(
            f"{path}{who}: a symlink to {target}, outside the model directory {root}; copy the file "
            "into the directory (vllm-port reads only files inside it)"
        )
    return path


def _allowed_roots(root: Path) -> list[Path]:
    """Where a model directory's symlinks may point: itself, and a hub cache's blobs for a snapshot directory."""
    resolved = root.resolve()
    allowed = [resolved]
    if resolved.parent.name == "snapshots":  # huggingface_hub's cache: snapshots/REV/FILE -> ../../blobs/HASH
        allowed.append(resolved.parent.parent / "blobs")
    return allowed


#: The largest JSON file of a model directory read (config.json is a few kB, a shard index of a
#: model with thousands of tensors a few hundred): a bigger one is not read into memory.
MAX_JSON_BYTES = 64 << 20
#: The deepest nesting of arrays and objects read from a model directory's JSON: config.json nests
#: three deep (``rope_scaling``, ``quantization_config``), a shard index two; Python's own parser
#: recurses once per level and fails past about a thousand, so anything deeper is refused first.
MAX_JSON_DEPTH = 32
#: The most digits of an integer in a model directory's JSON: every size and token id fits int64
#: (19 digits); Python refuses to convert integers of more than 4,300 digits at all.
MAX_JSON_INT_DIGITS = 20
#: A JSON string (group 1: its text), a key's colon after it (group 2), or a bracket; what
#: :func:`_check_depth` walks, so brackets inside strings are not counted.
_JSON_TOKENS = re.compile(r'"((?:[^"\\]|\\.)*)"(\s*:)?|[\[\]{}]')


def read_model_file(path: Path, what: str, limit: int) -> bytes:
    """The bytes of one file of a model directory: a regular file of at most ``limit`` bytes.

    A FIFO, device, socket or directory is refused before it is read (opening a FIFO for reading
    would wait for a writer; a device never ends), and the size is checked on the open file, so a
    file swapped for another between the two checks is still bounded.

    :raises ModelLoadError: naming the file, ``what`` it should be, and what it is instead.
    """
    try:
        _check_regular(path, os.stat(path), what)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            _check_regular(path, info, what)
            # no buffer beyond the file's size (a read of limit + 1 bytes would allocate them first)
            data = f.read(min(info.st_size, limit) + 1)
    except FileNotFoundError:
        raise ModelLoadError(
            f"{path}: no {what}; a Hugging Face model directory holds config.json beside its safetensors weights"
        ) from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read {what} ({exc}); re-download or re-save it") from exc
    if len(data) > limit:
        raise ModelLoadError(
            f"{path}: {what} is {max(info.st_size, len(data)):,} bytes; no model's {what} is over {limit:,}: the file "
            "is damaged or not what it claims; re-download or re-save it"
        )
    return data


def _check_regular(path: Path, info: os.stat_result, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
        raise ModelLoadError(
            f"{path}: {what} is a {kind}, not a regular file; vllm-port reads only regular files of a model "
            "directory: replace it with the file itself"
        )


_FILE_KINDS = (
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "FIFO (named pipe)"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
    (stat.S_ISSOCK, "socket"),
)


def check_regular_file(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (following symlinks); a missing one passes (callers say what is missing).

    :raises ModelLoadError: for a FIFO, device, socket or directory, naming the file and its kind.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read {what} ({exc}); re-download or re-save it") from exc
    _check_regular(path, info, what)


def read_json(path: Path, what: str) -> Mapping[str, Any]:
    """A JSON object from a model directory's file, refusing a missing, oversized, unreadable or non-object one.

    The file must be a regular file of at most :data:`MAX_JSON_BYTES`, nest at most
    :data:`MAX_JSON_DEPTH` deep and hold no integer of more than :data:`MAX_JSON_INT_DIGITS` digits.

    :raises ModelLoadError: naming the file, the field where one can be named, and what was wrong.
    """
    data = read_model_file(path, what, MAX_JSON_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"{path}: cannot read {what} as JSON ({exc}); re-download or re-save it") from exc
    _check_depth(path, what, text)
    try:
        raw = json.loads(text, parse_int=_bounded_int)
    except _IntTooLongError as exc:
        raise ModelLoadError(
            f"{path}: {_field_of_long_int(text)} of {what} is an integer of {exc.digits:,} digits; no size or token id "
            f"has more than {MAX_JSON_INT_DIGITS}: the file is damaged or not what it claims; re-download or re-save it"
        ) from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: cannot read {what} as JSON ({exc}); re-download or re-save it") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: {what} holds a {type(raw).__name__}; expected a JSON object")
    return raw


class _IntTooLongError(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_JSON_INT_DIGITS:
        raise _IntTooLongError(digits)
    return int(text)


def _field_of_long_int(text: str) -> str:
    """``field 'NAME'`` holding the first over-long integer of ``text``, or ``a value`` when it is in an array."""
    long_int = rf"-?\d{{{MAX_JSON_INT_DIGITS + 1},}}"
    for match in re.finditer(rf'"((?:[^"\\]|\\.)*)"\s*:\s*({long_int})|({long_int})', text):
        return f"field {match.group(1)!r}" if match.group(1) is not None else "a value in an array"
    return "a value"


def _check_depth(path: Path, what: str, text: str) -> None:
    """Refuse JSON nested deeper than :data:`MAX_JSON_DEPTH`, naming the top-level field that holds the nesting."""
    depth, field = 0, None
    for match in _JSON_TOKENS.finditer(text):
        lexeme = match.group(0)
        if match.group(2) is not None and depth == 1:
            field = match.group(1)
        elif lexeme in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                where = f"field {field!r}" if field is not None else "its top level"
                raise ModelLoadError(
                    f"{path}: {where} of {what} nests arrays and objects more than {MAX_JSON_DEPTH} deep; no model's "
                    f"{what} nests more than a few levels: the file is damaged or not what it claims; re-download it"
                )
        elif lexeme in ("]", "}"):
            depth -= 1


def _architecture(fields: _Fields) -> str:
    names = fields.raw.get("architectures")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise fields.fail("architectures", f"a list naming one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if names[0] not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{fields.path}: architecture {names[0]!r} (field 'architectures') is not supported; "
            f"vllm-port runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return names[0]


def _checkpoint_dtype(fields: _Fields) -> torch.dtype:
    name = "dtype" if "dtype" in fields.raw else "torch_dtype"
    value = fields.raw.get(name)
    if value is None:  # absent or null: transformers' own default (a config it writes without a dtype holds null)
        value = "float32"
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise fields.fail(name, "a floating-point dtype name such as 'bfloat16', 'float16' or 'float32'")
    return dtype


def _rope(fields: _Fields, default_theta: float) -> tuple[float, Mapping[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or ``rope_theta``/``rope_scaling``.

    Both present and saying different things is refused: transformers takes ``rope_scaling``'s type
    over ``rope_parameters``', and reading one of them would run the model with the other's rope.
    """
    both = [k for k in ("rope_parameters", "rope_scaling") if fields.raw.get(k) is not None]
    if len(both) == 2 and _rope_kind(fields.raw["rope_parameters"]) != _rope_kind(fields.raw["rope_scaling"]):
        raise ModelLoadError(
            f"{fields.path}: fields 'rope_parameters' and 'rope_scaling' are both set and disagree "
            f"({fields.raw['rope_parameters']!r:.120} against {fields.raw['rope_scaling']!r:.120}); transformers "
            "takes rope_scaling's: keep the one the model was trained with and remove the other"
        )
    key = both[0] if both else "rope_scaling"
    params = fields.raw.get(key)
    if params is None:
        return fields.get_float("rope_theta", default_theta), None
    if not isinstance(params, dict):
        raise fields.fail(key, "an object of rope parameters or null")
    if "rope_type" not in params and "type" not in params and any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(
            f"{fields.path}: field {key!r} holds rope parameters per layer type ({sorted(params)}); one rope for "
            "every layer is supported: give {'rope_type': ..., 'rope_theta': ...}"
        )
    sub = _Fields(fields.path, params, prefix=f"{key}.")
    theta = sub.get_float("rope_theta", fields.raw.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{fields.path}: rope scaling type {rope_type!r} (field {key!r}) is not supported; "
            f"supported: {', '.join(ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling: dict[str, Any] = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
    scaling["rope_type"] = rope_type
    for name in _LLAMA3_KEYS[:3]:
        scaling[name] = sub.get_float(name)
    scaling["original_max_position_embeddings"] = sub.get_int("original_max_position_embeddings")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise sub.fail("high_freq_factor", f"a number above low_freq_factor ({scaling['low_freq_factor']})")
    return theta, MappingProxyType(scaling)


def _rope_kind(params: Any) -> Any:
    """What a rope object asks for, whichever key spells its type, without its theta (compared, not used)."""
    if not isinstance(params, dict):
        return params
    kind = {k: v for k, v in params.items() if k not in ("type", "rope_type", "rope_theta")}
    return params.get("rope_type", params.get("type", "default")), kind


def _sliding_window(fields: _Fields, architecture: str, num_layers: int) -> int:
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        if "sliding_window" not in fields.raw:  # absent is the class's default; null is no window
            return int(ARCHITECTURE_DEFAULTS.get(architecture, {}).get("sliding_window", 0))
        return fields.get_int("sliding_window", 0, minimum=0)
    qwen = ("Qwen2ForCausalLM", *_QK_NORM)
    if architecture not in qwen or not fields.get_bool("use_sliding_window", False):
        return 0
    if architecture == "Qwen3MoeForCausalLM":
        raise ModelLoadError(
            f"{fields.path}: field 'use_sliding_window' is true, which Qwen3MoeForCausalLM does not support here: "
            "transformers versions disagree on which of its layers slide (released Qwen3-MoE configs set it false)"
        )
    # Qwen2 slides only in the layers at or above max_window_layers (layer_types spells it out in transformers 5)
    window = fields.get_int("sliding_window")
    types = fields.raw.get("layer_types")
    if types is None:
        first = fields.get_int("max_window_layers", 28, minimum=0)  # transformers' default
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise fields.fail("layer_types", f"a list of {num_layers} layer types")
    if all(t == "full_attention" for t in types):
        return 0
    if all(t == "sliding_attention" for t in types):
        return window
    raise ModelLoadError(
        f"{fields.path}: fields 'use_sliding_window'/'layer_types' ask for a sliding window in some layers only "
        f"({types}); the flat model applies one window to every layer: set use_sliding_window to false"
    )


def _moe(fields: _Fields, architecture: str, num_layers: int) -> MoeConfig | None:
    """The experts of a MoE architecture, every field checked; None for a dense one."""
    if architecture not in _MOE:
        return None
    if architecture == "MixtralForCausalLM":
        experts = fields.get_int("num_local_experts", 8)
        return MoeConfig(experts, _top_k(fields, experts), fields.get_int("intermediate_size"), True,
                         (True,) * num_layers)  # fmt: skip
    # Qwen3-MoE: transformers 4 writes num_experts, transformers 5 num_local_experts
    experts = fields.get_int("num_experts" if "num_experts" in fields.raw else "num_local_experts", 128)
    step = fields.get_int("decoder_sparse_step", 1)
    dense = fields.raw.get("mlp_only_layers", [])
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise fields.fail("mlp_only_layers", "a list of layer indices (the layers with a dense MLP)")
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    return MoeConfig(
        experts,
        _top_k(fields, experts),
        fields.get_int("moe_intermediate_size"),
        fields.get_bool("norm_topk_prob", False),
        sparse,
    )


def _top_k(fields: _Fields, experts: int) -> int:
    top_k = fields.get_int("num_experts_per_tok")
    if top_k > experts:
        raise fields.fail("num_experts_per_tok", f"at most the number of experts ({experts})")
    return top_k


def _refuse_unsupported(fields: _Fields, architecture: str) -> None:
    if fields.get_str("hidden_act", "silu") != "silu":
        raise fields.fail("hidden_act", "'silu' (the gated MLP of Llama-family models)")
    if architecture == "LlamaForCausalLM" and fields.get_bool("mlp_bias", False):
        raise fields.fail("mlp_bias", "false (MLP biases are not supported)")
    if architecture == "Qwen3MoeForCausalLM" and fields.raw.get("shared_expert_intermediate_size"):
        raise fields.fail("shared_expert_intermediate_size", "absent or 0 (Qwen3-MoE has no shared expert)")


#: What a Hugging Face hub id looks like: ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def refuse_hub_id(model: str | os.PathLike[str]) -> None:
    """Refuse a model that is not a local directory, saying how to get one when it reads as a hub id.

    Models load from local directories only: the engine never reaches the network at run time.

    :raises ModelLoadError: for a path that does not exist and looks like ``org/name``.
    """
    text = os.fspath(model)
    if Path(text).exists() or not _HUB_ID.fullmatch(text):
        return  # a missing plain path gets the missing file's own message
    raise ModelLoadError(
        f"{text}: no such local directory. If {text!r} is a Hugging Face hub id: only local directories load "
        "(the engine never reaches the network at run time); download it first with "
        f"`huggingface-cli download {text} --local-dir DIR` (or `hf download {text} --local-dir DIR`), "
        "then pass DIR as the model"
    )


def load_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """Read and check ``config.json`` (and ``generation_config.json``'s end-of-sequence ids) of ``model_dir``.

    :raises ModelLoadError: for a missing or unreadable file, an unsupported architecture or rope
        scaling, or a field that is missing or of the wrong type or value; the message names the field.
    """
    refuse_hub_id(model_dir)
    path = model_file(model_dir, "config.json")
    fields = _Fields(path, read_json(path, "config.json"))
    architecture = _architecture(fields)
    _refuse_unsupported(fields, architecture)
    hidden, heads = fields.get_int("hidden_size"), fields.get_int("num_attention_heads")
    kv_heads = fields.get_int("num_key_value_heads", heads)
    head_size = fields.get_int("head_dim", None)
    if head_size is None:
        if hidden % heads:
            raise fields.fail("num_attention_heads", f"a divisor of hidden_size {hidden} (or set head_dim)")
        head_size = hidden // heads
    if heads % kv_heads:
        raise fields.fail("num_key_value_heads", f"a divisor of num_attention_heads {heads}")
    if head_size % 2:
        raise fields.fail("head_dim", "an even head size (rotary embedding rotates pairs of features)")
    num_layers = fields.get_int("num_hidden_layers")
    defaults = ARCHITECTURE_DEFAULTS.get(architecture, {})
    rope_theta, rope_scaling = _rope(fields, defaults.get("rope_theta", 10000.0))
    eos = fields.token_ids("eos_token_id")
    generation = model_file(model_dir, "generation_config.json")
    if generation.exists():
        more = _Fields(generation, read_json(generation, "generation_config.json")).token_ids("eos_token_id")
        eos += tuple(t for t in more if t not in eos)
    moe, quantization = _moe(fields, architecture, num_layers), read_quantization(path, fields.raw)
    if moe is not None and quantization is not None:
        raise ModelLoadError(
            f"{path}: field 'quantization_config' makes an FP8 checkpoint of a mixture-of-experts model "
            f"({architecture}); fused_moe takes float experts, so FP8 experts are not supported yet: use the "
            "unquantized weights"
        )
    return ModelConfig(
        architecture=architecture,
        vocab_size=fields.get_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=fields.get_int("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        rms_norm_eps=fields.get_float("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=fields.get_int("max_position_embeddings"),
        tie_word_embeddings=fields.get_bool("tie_word_embeddings", False),
        attention_bias={"Qwen2ForCausalLM": True, "MistralForCausalLM": False, "MixtralForCausalLM": False}.get(
            architecture, fields.get_bool("attention_bias", False)
        ),
        sliding_window=_sliding_window(fields, architecture, num_layers),
        dtype=_checkpoint_dtype(fields),
        bos_token_id=fields.get_int("bos_token_id", None, minimum=0),
        eos_token_ids=eos,
        qk_norm=architecture in _QK_NORM,
        moe=moe,
        quantization=quantization,
    )


#: ``generation_config.json``'s sampling fields that become a request's defaults, as vLLM reads them
#: (``max_new_tokens`` as ``max_tokens``); its other fields are not sampling settings this engine takes.
SAMPLING_DEFAULT_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def read_sampling_defaults(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The sampling defaults a model ships in ``generation_config.json``, by ``SamplingParams`` field name.

    vLLM applies these (``--generation-config auto``, its default) to every request that leaves the
    field out: an instruct model's ``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty`` and ``max_new_tokens``. As vLLM, ``do_sample`` is not read. No file, or
    none of these fields: ``{}``.

    :raises ModelLoadError: naming the file and the field whose value is not a number (an int for
        ``top_k`` and ``max_new_tokens``).
    """
    path = model_file(model_dir, "generation_config.json")
    if not path.exists():
        return {}
    raw = read_json(path, "generation_config.json")
    defaults: dict[str, Any] = {}
    for name, field in SAMPLING_DEFAULT_FIELDS.items():
        value = raw.get(name)
        if value is None:
            continue
        integral = name in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            expected = "an int" if integral else "a number"
            raise ModelLoadError(f"{path}: field '{name}' is {value!r} ({type(value).__name__}); expected {expected}")
        defaults[field] = value if integral else float(value)
    return defaults
