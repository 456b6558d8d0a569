"""The steps a profile times: each phase's inputs, and its graph and LM head run plain or with a range per node.

The steps are the flat graphs :class:`~vllm_port.flat.FlatModel` runs eagerly (after the fusion
passes), followed by what a runner does after the graph: pick the rows that need logits and run the
LM head. A copy of each graph's eager module has every kernel node wrapped in a
``torch.profiler.record_function`` range named after the node; the plain graph is left untouched,
so profiling costs nothing when it is off. Each node is recorded with its op, provider, plugin,
model layer and stack layer; :func:`collective_name` tells the comm layer's nodes and events apart.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.profiler import record_function

from ..flat import FlatGraph, FlatModel, graph_inputs
from ..flat.trace import StepInputs
from .schema import ProfileError
from .subject import importer_of

__all__ = ["LABEL", "collective_name"]

#: Prefix of every profiler range the profile opens (here around nodes, in :mod:`.timing` around steps).
LABEL = "vllm_port.profile"
#: Collective calls as torch.distributed and the collective libraries spell them, without underscores.
_COLLECTIVES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
}
_COLLECTIVE = re.compile("|".join(sorted(_COLLECTIVES, key=len, reverse=True)))
#: Who issues collectives: torch.distributed (``c10d::``, traced ``_c10d_functional``) and the libraries.
_COMM_LIBRARY = re.compile(r"^(_?c10d|nccl|rccl|gloo|xccl|oneccl|ccl)", re.IGNORECASE)


def collective_name(name: str) -> str | None:
    """The collective a profiler event or graph op name stands for (``"all_reduce"``), or ``None``.

    Matches the spellings of torch.distributed (``c10d::allreduce_``) and of the collective libraries
    (``nccl:all_reduce``, ``gloo:all_gather``); contract and torch compute ops never match.
    """
    if not _COMM_LIBRARY.match(name):
        return None
    found = _COLLECTIVE.search(name.lower().replace("_", ""))
    return _COLLECTIVES[found.group(0)] if found else None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@dataclass
class _Step:
    """One phase's step: its inputs, its nodes and the two ways to run it (plain, and with a range per node)."""

    phase: str
    logits_rows: torch.Tensor
    run: Callable[[], torch.Tensor]
    run_ranged: Callable[[], torch.Tensor]
    nodes: list[dict[str, Any]]
    meta: StepInputs
    input_ids: torch.Tensor
    positions: torch.Tensor


def _batch(
    phase: str, tables: torch.Tensor, context: int, block_size: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, StepInputs, torch.Tensor]:
    """``(input_ids, positions, meta, logits_rows)``: each sequence prefills ``context`` tokens or decodes its last."""
    batch = tables.shape[0]
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    if phase == "decode":
        positions = torch.full((batch,), context - 1, dtype=torch.int64)
        per_seq = 1
    else:
        positions = torch.arange(context, dtype=torch.int64).repeat(batch)
        per_seq = context
    seq_of_token = torch.arange(batch).repeat_interleave(per_seq)
    slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    cu_seqlens = torch.arange(0, batch * per_seq + 1, per_seq, dtype=torch.int32)
    ids = torch.randint(0, vocab_size, (batch * per_seq,), generator=gen)
    meta = StepInputs(
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        seq_lens=seq_lens.to(device),
        cu_seqlens_q=cu_seqlens.to(device),
        max_query_len=per_seq,
        is_decode=phase == "decode",
    )
    return ids.to(device), positions.to(device), meta, (cu_seqlens[1:] - 1).to(device)


def _ranged(label: str, fn: Callable[..., Any], sync: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``fn`` run inside a profiler range called ``label``; ``sync`` (the device's) ends the range after its work."""

    def ranged(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            out = fn(*args, **kwargs)
            if sync is not None:
                sync()
            return out

    ranged.__name__ = ranged.__qualname__ = re.sub(r"\W", "_", label)  # fx code generation needs identifiers
    return ranged


def _instrumented(graph: FlatGraph, sync: Callable[[], None] | None = None) -> fx.GraphModule:
    """A copy of ``graph``'s eager module whose kernel nodes (every node but shape arithmetic) run in ranges."""
    module = graph.eager_module()
    by_fx_name = {graph.fx_node(n.name).name: n for n in graph.nodes if n.kind != "shape"}
    wrapped = 0
    for node in module.graph.nodes:  # the eager module's graph is a copy: fx keeps the node names
        flat = by_fx_name.get(node.name) if node.op == "call_function" else None
        if flat is not None:
            node.target = _ranged(f"{LABEL}/{graph.phase}/{flat.name}", node.target, sync)
            wrapped += 1
    if wrapped != len(by_fx_name):
        raise ProfileError(
            f"profile: {len(by_fx_name) - wrapped} nodes of the {graph.phase} graph were not found in its eager "
            "module (FlatGraph.eager_module renamed them); the profile would miss their time"
        )
    module.recompile()
    return module


def _node_record(name: str, op: str, kind: str, provider: str, plugin: str, layer: int | None) -> dict[str, Any]:
    stack = "ops" if kind in ("contract", "plugin") else ("comm" if collective_name(op) else "graph")
    return {
        "name": name,
        "op": op,
        "kind": kind,
        "provider": provider,
        "plugin": plugin,
        "layer": layer,
        "stack_layer": stack,
    }


def _make_step(flat: FlatModel, phase: str, caches: list[tuple[torch.Tensor, torch.Tensor]], inputs: tuple) -> _Step:
    ids, positions, meta, rows = inputs
    graph = flat.graph(phase)
    args = graph_inputs(ids, positions, caches, meta)
    sync = None if ids.device.type == "cpu" else (lambda: _synchronize(ids.device))
    ranged_graph = _instrumented(graph, sync)
    select = _ranged(f"{LABEL}/{phase}/logits_rows", torch.index_select, sync)
    lm_head, head_nodes = _lm_head(flat, phase, sync)

    def run() -> torch.Tensor:
        return flat.compute_logits(graph(*args).index_select(0, rows))

    def run_ranged() -> torch.Tensor:
        return lm_head(select(ranged_graph(*args), 0, rows))

    nodes = [
        _node_record(n.name, n.op, n.kind, n.provider, n.plugin, n.layer) for n in graph.nodes if n.kind != "shape"
    ]
    # after the graph, as the engine's runner does: the rows that need logits, then the LM head
    nodes.append(_node_record("logits_rows", str(torch.ops.aten.index_select.default), "native", "torch", "", None))
    nodes += head_nodes
    return _Step(phase, rows, run, run_ranged, nodes, meta, ids, positions)


def _lm_head(
    flat: FlatModel, phase: str, sync: Callable[[], None] | None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[dict[str, Any]]]:
    """The LM head as the runner runs it after the graph (logits of hidden rows), in ranges, and its nodes.

    A core model's head is one ``linear``: the node ``lm_head``. An imported model's head is the
    piece the importer rewrote from the causal LM's forward after its base model (an fx graph,
    ``ImportedModel.lm_head``): its ``linear`` is the node ``lm_head`` and every other call in it
    (a view; Gemma-2's final soft cap, which the importer leaves as native torch ops) a node of its
    own, ``lm_head.<name>``, so that what the importer left native is timed as in the layers.
    """
    linear = flat.kernels.providers["linear"]
    head = _node_record("lm_head", "linear", "contract", linear.name, linear.plugin, None)
    piece = getattr(flat.model, "lm_head", None)
    if importer_of(flat.model) is None or not isinstance(piece, fx.GraphModule):
        return _ranged(f"{LABEL}/{phase}/lm_head", flat.compute_logits, sync), [head]
    from ..importer._contract import CONTRACT_CALLS  # the calls a rewritten piece makes for contract ops

    ranged_piece = fx.GraphModule(piece, copy.deepcopy(piece.graph))  # shares the piece's weights
    nodes: list[dict[str, Any]] = []
    for node in ranged_piece.graph.nodes:
        if node.op != "call_function":
            continue
        ops = CONTRACT_CALLS.get(node.target, ())
        if ops == ("linear",) and head not in nodes:
            record = head
        elif len(ops) == 1:
            provider = flat.kernels.providers[ops[0]]
            record = _node_record(f"lm_head.{node.name}", ops[0], "contract", provider.name, provider.plugin, None)
        else:
            record = _node_record(f"lm_head.{node.name}", str(node.target), "native", "torch", "", None)
        node.target = _ranged(f"{LABEL}/{phase}/{record['name']}", node.target, sync)
        nodes.append(record)
    if head not in nodes:
        raise ProfileError(
            f"profile: the imported LM head ({type(flat.model).__name__}.lm_head) calls no contract linear; the "
            "profile cannot tell which node is the head's (inspect it with vllm-port inspect MODEL_DIR --import)"
        )
    ranged_piece.recompile()
    ranged_model = copy.copy(flat.model)  # shallow: the same layers and weights, the ranged head
    ranged_model.lm_head = ranged_piece

    def lm_head(hidden: torch.Tensor) -> torch.Tensor:
        return ranged_model.compute_logits(flat.kernels, hidden)

    return lm_head, nodes
