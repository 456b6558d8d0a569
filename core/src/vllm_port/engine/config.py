"""``EngineConfig``: every argument of ``LLM(...)`` as one value that checks itself (device-free, no torch import).

``LLM(model, max_num_seqs=...)`` makes one from its arguments; a caller that holds its settings as
data (a server, a CLI) makes one itself and builds the engine from it, with the same refusals, by
the same names, before any platform or model loads::

    config = EngineConfig(model="path/to/model", max_num_seqs=64)
    llm = LLM.from_config(config)          # what LLM(model="path/to/model", max_num_seqs=64) builds
    smaller = dataclasses.replace(config, max_num_seqs=8)   # checked again

What needs the platform or the model (the default block size, the dtype ``"auto"`` stands for,
``max_model_len`` against the model's ``max_position_embeddings``) is checked where those load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..runtime import Runtime
    from .runner import ModelRunner, StepFunction

__all__ = ["KV_CACHE_DTYPES", "RUNS_AHEAD_BY_DEFAULT", "EngineConfig"]

#: ``LLM(kv_cache_dtype=...)``'s values: ``"auto"`` caches in the model's dtype, the others in float8 e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
#: The most tokens a prefill or mixed step may hold to replay captured graphs (``EngineConfig.captured_rows``):
#: vLLM's default largest capture size. Past it a step's device work (a Llama-3-8B step of 512 tokens
#: computes for ~12 ms on an H200) outweighs its eager launches, and every captured size costs start-up time.
MAX_CAPTURED_TOKENS = 512
#: ``LLM(distributed_executor_backend=...)``'s values: ``None``/``"mp"`` spawn the ranks on this machine,
#: ``"external_launcher"`` makes this process one of the ranks a launcher (``torchrun``) started.
DISTRIBUTED_EXECUTOR_BACKENDS = (None, "mp", "external_launcher")


#: The platforms (by name) where ``async_scheduling=None`` runs steps ahead: those where it was measured to
#: pay (docs/results/async-scheduling-h200.md). Others run synchronously unless asked with ``True``.
RUNS_AHEAD_BY_DEFAULT: frozenset[str] = frozenset({"cuda"})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, as ``LLM``'s arguments of the same names (see :class:`~vllm_port.engine.LLM`).

    The four modes are told apart by the fields: plain (a model directory, or ``None`` for the
    bundled model), imported (``importer``, or ``model`` a ``transformers`` module), placed
    (``placement``/``devices``), tensor-parallel (``tensor_parallel_size > 1``) and pipeline-parallel
    (``pipeline_parallel_size > 1``).

    :raises ValueError: for a field of the wrong type or range, or fields that no mode combines,
        naming the field and what it must be (``LLM(max_num_seqs=0): max_num_seqs is 0; it must
        be an int >= 1 ...``).
    """

    model: str | os.PathLike[str] | torch.nn.Module | None = None
    device: str | Runtime = "auto"
    dtype: str | torch.dtype = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    kv_cache_memory: float | int | None = None
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    swap_space: int | None = None
    seed: int | None = None
    plugins: str | None = None
    make_step: Callable[[ModelRunner], StepFunction] | None = None
    enforce_eager: bool = False
    importer: str | None = None
    placement: Any = None
    devices: Sequence[str] | None = None
    gpu_memory_utilization: float | None = None
    tokenizer: str | os.PathLike[str] | None = None
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    kv_cache_dtype: str = "auto"
    distributed_executor_backend: str | None = None
    async_scheduling: bool | None = None
    pipeline_parallel_size: int = 1
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        # the cheap checks, all before anything loads: importing moves, casts and traces the user's module
        if self.imports and self.places:
            raise ValueError(
                "placement of imported models is not supported yet: an imported model (importer= or a transformers "
                "module) runs on one platform; drop placement/devices, or place the core model definitions "
                "(importer=None)"
            )
        for name, (accepts, expected) in _RULES.items():
            value = getattr(self, name)
            if not accepts(value):
                raise ValueError(f"LLM({name}={value!r:.80}): {name} is {value!r:.80}; it must be {expected}")
        if self.places and self.ranks != 1:
            raise ValueError(
                "placement runs the model in this process; use tensor_parallel_size=1 and pipeline_parallel_size=1 "
                "with placement"
            )
        if self.tensor_parallel_size != 1 and self.pipeline_parallel_size != 1:
            raise ValueError(
                f"LLM(tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}): tensor and pipeline parallelism do not combine yet; use one of them"
            )
        if self.pipeline_parallel_size != 1 and self.imports:
            raise ValueError(
                f"LLM(pipeline_parallel_size={self.pipeline_parallel_size}) with an imported model: pipeline stages "
                "load their layers from a core model definition's checkpoint; drop importer"
            )
        if self.block_size is not None and not (_is_int(self.block_size) and self.block_size >= 1):
            raise ValueError(
                f"block_size is {self.block_size!r}; it must be a positive int (tokens per KV-cache block)"
            )
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError(
                f"LLM(gpu_memory_utilization={self.gpu_memory_utilization!r}, kv_cache_memory={self.kv_cache_memory!r}): "
                "give one of them: gpu_memory_utilization sizes the KV cache from the device's total memory (what the "
                "weights and activations leave of that share), kv_cache_memory gives the cache's budget itself"
            )
        if self.launched and (self.places or self.make_step is not None or self.imports):
            raise ValueError(
                "distributed_executor_backend='external_launcher' runs this process as one rank of a core model "
                "definition's eager step; drop placement/devices, make_step and importer"
            )
        if self.async_scheduling and (self.ranks != 1 or self.launched):
            raise ValueError(
                f"LLM(async_scheduling=True, tensor_parallel_size={self.tensor_parallel_size}, pipeline_parallel_size="
                f"{self.pipeline_parallel_size}, distributed_executor_backend={self.distributed_executor_backend!r}): "
                "asynchronous scheduling runs one device's steps ahead in this process; with tensor or pipeline "
                "parallelism or launched ranks use async_scheduling=False"
            )
        if self.make_step is not None and self.ranks != 1:
            raise ValueError(
                "make_step runs in this process; with tensor_parallel_size > 1 or pipeline_parallel_size > 1 the ranks "
                "run their own steps"
            )

    @property
    def replayed_prefill_tokens(self) -> int:
        """The most tokens a prefill or mixed step replaying captured graphs holds: :data:`MAX_CAPTURED_TOKENS`,
        at most ``max_num_batched_tokens``."""
        return min(self.max_num_batched_tokens, MAX_CAPTURED_TOKENS)

    @property
    def captured_rows(self) -> int:
        """The largest step captured as graphs, in rows: ``max_num_seqs`` sequences of a decode step, or
        :attr:`replayed_prefill_tokens` tokens of any other step."""
        return max(self.max_num_seqs, self.replayed_prefill_tokens)

    @property
    def ranks(self) -> int:
        """The processes the model is split over: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def imports(self) -> bool:
        """The model comes through an importer: ``importer`` is set, or ``model`` is a ``torch.nn.Module``."""
        torch = sys.modules.get("torch")  # a module object cannot exist before torch is imported
        return self.importer is not None or (torch is not None and isinstance(self.model, torch.nn.Module))

    @property
    def launched(self) -> bool:
        """This process is one rank of several a launcher started (``distributed_executor_backend='external_launcher'``)."""
        return self.distributed_executor_backend == "external_launcher"

    @property
    def places(self) -> bool:
        """The model's parts run on several platforms (``placement`` or ``devices`` is given)."""
        return self.placement is not None or self.devices is not None

    def runs_ahead_on(self, platform: str) -> bool:
        """Whether steps run ahead (``async_scheduling``) on the platform named ``platform``: as given, else
        where it was measured to pay (vLLM's default is on as well): one device of a platform in
        :data:`RUNS_AHEAD_BY_DEFAULT` running a core model definition. On a host (``"cpu"``) the host's work has
        nothing to hide behind (docs/results/async-scheduling-h200.md); ROCm and XPU were never measured.
        """
        if self.async_scheduling is not None:
            return self.async_scheduling
        one_device = self.ranks == 1 and not (self.launched or self.places or self.imports or self.make_step)
        return one_device and platform in RUNS_AHEAD_BY_DEFAULT

    def as_arguments(self) -> dict[str, Any]:
        """The fields by name, as ``LLM(**config.as_arguments())`` takes them (values as they are, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Each checked field, what it accepts and what it must be, in the order they are checked.
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tensor_parallel_size": (lambda v: _is_int(v) and v >= 1, "an int >= 1 (devices to shard the model over)"),
    "pipeline_parallel_size": (
        lambda v: _is_int(v) and v >= 1,
        "an int >= 1 (stages to split the model's layers into, one device each)",
    ),
    "max_model_len": (lambda v: v is None or (_is_int(v) and v >= 2), "None or an int >= 2 (prompt and output)"),
    "kv_cache_memory": (
        lambda v: v is None or (_is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0),
        "None (the platform's default), a fraction in (0, 1] of the free device memory, or an int of bytes >= 1",
    ),
    "max_num_seqs": (lambda v: _is_int(v) and v >= 1, "an int >= 1 (the most requests running at once)"),
    "max_num_batched_tokens": (lambda v: _is_int(v) and v >= 1, "an int >= 1 (tokens one step may run)"),
    "enable_prefix_caching": (lambda v: isinstance(v, bool), "True or False"),
    "swap_space": (lambda v: v is None or (_is_int(v) and v >= 0), "None or an int of bytes >= 0 (0: no swap)"),
    "seed": (lambda v: v is None or _is_int(v), "None or an int"),
    "plugins": (lambda v: v is None or isinstance(v, str), "None or an allow/deny list such as 'cpu' or '-rocm'"),
    "enforce_eager": (lambda v: isinstance(v, bool), "True or False"),
    "async_scheduling": (lambda v: v is None or isinstance(v, bool), "True, False or None (on for one accelerator)"),
    "kv_cache_dtype": (
        lambda v: v in KV_CACHE_DTYPES,
        "'auto' (the model's dtype) or 'fp8' / 'fp8_e4m3' (float8 e4m3 with scales of 1.0, vLLM's spelling); "
        "'fp8_e5m2' and 'fp8_inc' are not supported",
    ),
    "distributed_executor_backend": (
        lambda v: v in DISTRIBUTED_EXECUTOR_BACKENDS,
        "None or 'mp' (the ranks spawned on this machine) or 'external_launcher' (this process is one rank that "
        "torchrun started, on one machine or several: docs/multi-node.md); 'ray' and 'uni' are not supported",
    ),
    "gpu_memory_utilization": (
        lambda v: v is None or (_is_number(v) and 0.0 < v <= 1.0),
        "None or a fraction in (0, 1] of the device's total memory the engine may use in all (weights, activations "
        "and KV cache; on a host platform, of the host's memory)",
    ),
    "tokenizer": (
        lambda v: v is None or isinstance(v, (str, os.PathLike)),
        "None (the model's tokenizer.json) or a local directory holding a tokenizer.json, or the file's path",
    ),
    "tokenizer_mode": (
        lambda v: v in ("auto", "hf"),
        "'auto' (or 'hf'): the tokenizer.json, through the tokenizers library; slow, mistral and custom tokenizers "
        "are not supported",
    ),
    "generation_config": (
        lambda v: isinstance(v, (str, os.PathLike)) and (v in ("auto", "vllm") or os.path.isdir(v)),
        "'auto' (the model's generation_config.json), 'vllm' (SamplingParams' own defaults) or a directory holding "
        "a generation_config.json",
    ),
    "trust_remote_code": (
        lambda v: v is False,
        "False: the engine never runs code from a model directory (it loads the architectures of vllm_port.models, "
        "or transformers' own with importer='hf'); drop trust_remote_code",
    ),
}
