"""Trace a model step into a :class:`~vllm_port.flat.flat_graph.FlatGraph`.

The tracer is ``make_fx`` with symbolic shapes: it runs the model's flat ``forward`` once on fake
tensors (no kernel runs, no memory is touched) with bound ops wrapped as custom ops, so each
contract op is one node, torch ops are recorded at the aten level (``chunk`` becomes ``split``,
``x + r`` becomes ``aten.add.Tensor``: one spelling per operation, which is what fusion passes
match), and every node carries its output shape. The batch dimensions (tokens, sequences, blocks
of a block table, cache blocks, the longest query) are symbols, so one graph serves every batch;
layer counts, hidden sizes and the cache's block layout are constants. Prefill and decode trace
to separate graphs: ``is_decode`` picks the attention op, so it is fixed per graph.

A model is anything with a ``config`` (``num_layers``, ``num_kv_heads``, ``head_size``) and
``forward(ops, input_ids, positions, kv_caches, meta)`` that calls bound ops: the Llama family of
``vllm_port.models`` and any model written the same way. Weights are the tensors the model holds;
each node that reads one names it by the attribute path it was found at (``layers.3.qkv``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ..errors import VllmPortError
from ..ops import BoundOps
from .flat_graph import FlatGraph, traceable_ops

__all__ = ["PHASES", "StepInputs", "TraceError", "graph_inputs", "trace", "weight_paths"]

PHASES = ("decode", "prefill")
#: The graph's inputs before the caches, in call order: the token batch and the attention metadata.
BATCH_INPUTS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "cu_seqlens_q",
    "max_query_len",
    "num_decodes",
)


class TraceError(VllmPortError):
    """A model step cannot be traced into a flat graph; the message names the model and what stopped it."""


class FlatModelLike(Protocol):
    """What :func:`trace` needs of a model (``vllm_port.models.LlamaModel`` is one)."""

    config: Any

    def forward(
        self, ops: BoundOps, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any
    ) -> Any: ...


@dataclass
class StepInputs:
    """The attention metadata a model's ``forward`` reads, rebuilt from a flat graph's inputs.

    It has the fields of ``vllm_port.models.llama.AttentionMetadata``; models read it by attribute,
    so the flat layer needs no import of the model package (which sits above it).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_query_len: int
    is_decode: bool
    num_decodes: int = 0


def graph_inputs(input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: Any) -> list[Any]:
    """The positional arguments of a flat graph for one step (``meta`` is an ``AttentionMetadata``)."""
    caches = [t for pair in kv_caches for t in pair]
    return [
        input_ids,
        positions,
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        int(meta.max_query_len),
        int(getattr(meta, "num_decodes", 0)),
        *caches,
    ]


def step_function(
    model: FlatModelLike, ops: BoundOps, phase: str, num_layers: int, metadata: Callable[..., Any] = StepInputs
) -> Callable[..., Any]:
    """``model.forward`` as a function of flat arguments (see :data:`BATCH_INPUTS`, then each layer's K and V cache)."""
    is_decode = phase == "decode"

    def step(
        input_ids, positions, slot_mapping, block_tables, seq_lens, cu_seqlens_q, max_query_len, num_decodes, *caches
    ):
        meta = metadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            max_query_len=max_query_len,
            is_decode=is_decode,
            num_decodes=num_decodes,
        )
        kv_caches = [(caches[2 * i], caches[2 * i + 1]) for i in range(num_layers)]
        return model.forward(ops, input_ids, positions, kv_caches, meta)

    return step


def weight_paths(model: object, max_depth: int = 5) -> dict[int, str]:
    """``id(tensor) -> path`` for every tensor reachable from ``model``'s attributes (``layers.3.qkv``)."""
    found: dict[int, str] = {}
    for path, tensor in _walk_tensors(model, max_depth):
        found.setdefault(id(tensor), path)
    return found


def _walk_tensors(model: object, max_depth: int) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``model`` through dicts, sequences, dataclasses and plain objects."""
    found: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()

    def walk(value: Any, path: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append((path, value))
            return
        if depth > max_depth or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = [(str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(str(i), v) for i, v in enumerate(value)]
        elif isinstance(value, torch.nn.Module):
            items = list(value.state_dict(keep_vars=True).items())
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
        elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
            items = list(vars(value).items())
        else:
            return
        for key, item in items:
            walk(item, f"{path}.{key}" if path else key, depth + 1)

    walk(model, "", 0)
    return found


def _model_device(model: object) -> torch.device:
    tensors = _walk_tensors(model, 5)
    return tensors[0][1].device if tensors else torch.device("cpu")


#: Example sizes of the symbolic dimensions. Each is >= 2 (torch specialises sizes 0 and 1) and
#: distinct from the others, because equal example sizes share one symbol (duck shaping): decode's
#: tokens and sequences are equal on purpose (one query token per sequence).
_EXAMPLE = {
    "decode": {"num_tokens": 3, "num_seqs": 3, "max_blocks": 5, "num_blocks": 7, "max_query_len": 1},
    "prefill": {
        "num_tokens": 11,
        "num_seqs": 3,
        "max_blocks": 5,
        "num_blocks": 7,
        "max_query_len": 6,
        "num_decodes": 2,
    },
}


def _fake_inputs(
    mode: FakeTensorMode,
    phase: str,
    num_layers: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    dtype,
    device,
    cache_dtype=None,
) -> tuple[list[Any], dict[str, str]]:
    size = _EXAMPLE[phase]
    tokens, seqs, blocks, cache_blocks = size["num_tokens"], size["num_seqs"], size["max_blocks"], size["num_blocks"]

    def fake(name: str, shape: tuple[int, ...], dtype: torch.dtype, dynamic: tuple[bool, ...]) -> torch.Tensor:
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DUCK if d else DimDynamic.STATIC for d in dynamic],
            constraint_sizes=[None] * len(shape),
        )
        real = torch.empty(shape, dtype=dtype, device=device)  # a few bytes: the sizes are the small examples
        return mode.from_tensor(real, symbolic_context=context, source=ConstantSource(name))

    i64, i32 = torch.int64, torch.int32
    args: list[Any] = [
        fake("input_ids", (tokens,), i64, (True,)),
        fake("positions", (tokens,), i64, (True,)),
        fake("slot_mapping", (tokens,), i64, (True,)),
        fake("block_tables", (seqs, blocks), i32, (True, True)),
        fake("seq_lens", (seqs,), i32, (True,)),
        fake("cu_seqlens_q", (seqs + 1,), i32, (True,)),
    ]
    if phase == "prefill":  # the query tokens' most and the leading decode rows: ints of the step, symbolic
        env = mode.shape_env
        for name in ("max_query_len", "num_decodes"):
            source = ConstantSource(name)
            symbol = env.create_symbol(size[name], source, dynamic_dim=DimDynamic.DYNAMIC)
            args.append(env.create_symintnode(symbol, hint=size[name], source=source))
    else:
        args += [1, 0]  # decode: one query token per sequence, and no split
    cache_shape = (cache_blocks, block_size, kv_heads, head_size)
    for layer in range(num_layers):
        for kind in "kv":
            args.append(fake(f"{kind}_cache_{layer}", cache_shape, cache_dtype or dtype, (True, False, False, False)))
    # Name each symbol after the first input dimension that introduced it (seqs first in decode, where they are the batch).
    order = [("seq_lens", 0, "num_seqs"), ("input_ids", 0, "num_tokens")]
    if phase == "prefill":
        order.reverse()
    order += [("block_tables", 1, "max_blocks"), ("cu_seqlens_q", 0, "num_seqs_plus_1"), ("k_cache_0", 0, "num_blocks")]
    batch = len(BATCH_INPUTS)
    by_input = dict(
        zip([*BATCH_INPUTS, "k_cache_0"], [*args[:batch], args[batch] if num_layers else None], strict=True)
    )
    names: dict[str, str] = {}
    for input_name, dim, friendly in order:
        value = by_input[input_name]
        if isinstance(value, torch.Tensor) and isinstance(value.shape[dim], torch.SymInt):
            names.setdefault(str(value.shape[dim].node.expr), friendly)
    if phase == "prefill":
        names.setdefault(str(args[6].node.expr), "max_query_len")
        names.setdefault(str(args[7].node.expr), "num_decodes")
    return args, names


def trace(
    model: FlatModelLike,
    kernels: BoundOps,
    *,
    phase: str = "decode",
    block_size: int = 16,
    metadata: Callable[..., Any] = StepInputs,
    cache_dtype: torch.dtype | None = None,
) -> FlatGraph:
    """Trace one step of ``model`` (``phase`` ``"decode"`` or ``"prefill"``) into a flat graph.

    :param kernels: the bound ops the model calls (eager or traceable bindings; each becomes a
        custom op while tracing, so every contract op is one node naming its provider).
    :param block_size: the KV cache's block size (a constant of the graph).
    :param metadata: builds the ``meta`` argument from the flat inputs (by keyword).
    :param cache_dtype: the KV cache's dtype (default the kernels' dtype); a float8 cache traces the model's
        ``*_fp8`` cache ops, so a graph serves only caches of the dtype it was traced with.
    :raises TraceError: when ``phase`` is unknown or the model's code cannot be traced.
    """
    if phase not in PHASES:
        raise TraceError(f"trace: phase must be one of {PHASES}, got {phase!r}")
    config = model.config
    try:
        num_layers, kv_heads, head_size = int(config.num_layers), int(config.num_kv_heads), int(config.head_size)
    except AttributeError as exc:
        raise TraceError(
            f"trace: {type(model).__name__}.config lacks {exc.name!r}; a flat model's config needs num_layers, "
            "num_kv_heads and head_size (see vllm_port.models.ModelConfig)"
        ) from exc
    ops = traceable_ops(kernels)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    device = _model_device(model)
    args, symbol_names = _fake_inputs(
        mode, phase, num_layers, kv_heads, head_size, block_size, kernels.context.dtype, device, cache_dtype
    )
    step = step_function(model, ops, phase, num_layers, metadata)
    try:
        with torch.no_grad():
            module = make_fx(step, tracing_mode="symbolic", _allow_non_fake_inputs=True)(*args)
    except Exception as exc:
        raise TraceError(
            f"trace: {type(model).__name__}.forward ({phase}) could not be traced: {type(exc).__name__}: {exc}. "
            "Flat models call bound ops and torch only, with no host reads of tensor values (.item(), .tolist())"
        ) from exc
    names = weight_paths(model)
    weights = {}
    for node in module.graph.nodes:
        if node.op == "get_attr":
            weights[str(node.target)] = names.get(id(getattr(module, str(node.target))), str(node.target))
    input_names = [*BATCH_INPUTS, *(f"{kind}_cache_{i}" for i in range(num_layers) for kind in "kv")]
    return FlatGraph(
        module,
        phase=phase,
        input_names=input_names,
        weight_names=weights,
        symbol_names=symbol_names,
        kernels=ops,
    )
