"""Flat models: a model step as a flat graph of contract ops, fusion passes, the ``vllm_port`` torch.compile backend.

::

    graph = flat.trace(model, runtime.bind(dtype), phase="decode")   # FlatGraph: print it, compare it
    graph = flat.apply_passes(graph, runtime)                         # fused_add_rms_norm, silu_and_mul, ...
    hidden = graph(*flat.graph_inputs(input_ids, positions, kv_caches, meta))   # eager, bound kernels
    runner = flat.FlatModel(model, runtime)                           # eager or compiled; decode capture

See docs/flat-and-compile.md.
"""

from __future__ import annotations

from .backend import CompileReport, VllmPortBackend, make_backend
from .capture import DecodeGraphs
from .flat_graph import FlatGraph, FlatNode, contract_op, contract_provider, node_kind, traceable_ops
from .flat_model import FlatModel
from .passes import GraphPass, PassContext, apply_passes, core_passes
from .trace import PHASES, StepInputs, TraceError, graph_inputs, trace

__all__ = [
    "PHASES",
    "CompileReport",
    "DecodeGraphs",
    "FlatGraph",
    "FlatModel",
    "FlatNode",
    "GraphPass",
    "PassContext",
    "StepInputs",
    "TraceError",
    "VllmPortBackend",
    "apply_passes",
    "contract_op",
    "contract_provider",
    "core_passes",
    "graph_inputs",
    "make_backend",
    "node_kind",
    "trace",
    "traceable_ops",
]
