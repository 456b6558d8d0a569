"""A model on a platform, run as flat graphs: eagerly with the bound kernels, or through ``torch.compile``.

:class:`FlatModel` traces the model's prefill and decode steps once each (shapes symbolic in the
batch), runs the fusion passes (core's and the plugins'), and then serves ``forward`` like the
model itself does. Compilation is optional: ``compile=None`` compiles where the platform names a
compiler (``PlatformDescription.compile_backend``; ``"none"`` means it has none) and otherwise runs
the same graphs eagerly, each node its bound provider, at full correctness. Decode steps can
additionally be captured per batch size (:meth:`FlatModel.capture_decode`) on platforms that
offer graph capture, compiled or not.
"""

from __future__ import annotations

import gc
import itertools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import OpInputError
from ..graph_capture import GraphCapture
from .backend import NO_COMPILER, VllmPortBackend, resolve_compiler
from .capture import DecodeGraphs
from .flat_graph import FlatGraph, traceable_ops
from .passes import apply_passes
from .trace import PHASES, StepInputs, graph_inputs, step_function, trace

__all__ = ["FlatModel"]

#: Numbers the steps FlatModels compile (:func:`_own_code`).
_COMPILED_STEPS = itertools.count()


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own, under a name of its own.

    Dynamo keeps what it compiled on the code object of the function it compiles, and what it learnt about its
    inputs (which became dynamic) under the code's file, line and name. The steps of every FlatModel are closures
    of one function, so they would share both: a second model's first call would recompile the first model's
    entry, automatic dynamic would make a float that differs between the models (the attention scale) symbolic,
    which the ops' schemas refuse, and after ``recompile_limit`` models dynamo would stop compiling. With a code
    object and a name of its own, each FlatModel compiles from scratch, and its compiled graphs go when it does.
    """
    code = fn.__code__
    number = next(_COMPILED_STEPS)
    code = code.replace(co_name=f"{code.co_name}_{number}", co_qualname=f"{code.co_qualname}_{number}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


class FlatModel:
    """``model`` run as flat graphs on ``runtime``'s platform; see the module docstring.

    :param model: a flat model (``vllm_port.models.LlamaModel``).
    :param dtype: the dtype to bind ops for (default: the model's).
    :param compile: ``True`` compiles with the ``vllm_port`` backend, ``False`` runs eagerly,
        ``None`` compiles only where the platform has a compiler.
    :param passes: run the fusion passes (both modes).
    :param block_size: the KV cache's block size.
    :param cache_dtype: the KV cache's dtype, when it is not ``dtype`` (a float8 cache: the ``*_fp8`` cache ops);
        by default that of the first caches the model runs on, unless a graph was traced before.
    :param compiler: the compiler for the pieces (default: the plugin's, else the platform's).
    :param compile_trivial: compile pieces that hold only contract ops and views too (see
        :mod:`vllm_port.flat.backend`; by default they run as traced).
    """

    def __init__(
        self,
        model: Any,
        runtime: Any,
        dtype: torch.dtype | None = None,
        *,
        compile: bool | None = None,
        passes: bool = True,
        block_size: int = 16,
        compiler: str | Callable[..., Any] | None = None,
        compile_trivial: bool = False,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.runtime = runtime
        self.dtype = dtype or getattr(model, "dtype", torch.float32)
        self.kernels = runtime.bind(self.dtype)
        self.passes = passes
        self.block_size = block_size
        self.cache_dtype = cache_dtype
        self.compiler = resolve_compiler(runtime, compiler)
        has_compiler = not (isinstance(self.compiler, str) and self.compiler in NO_COMPILER)
        self.compiled = has_compiler if compile is None else compile
        self.backend = VllmPortBackend(runtime, self.dtype, self.compiler, passes, compile_trivial=compile_trivial)
        self._graphs: dict[str, FlatGraph] = {}
        self._steps: dict[str, Callable[..., Any]] = {}

    @property
    def mode(self) -> str:
        """``"compiled"`` or ``"eager"``."""
        return "compiled" if self.compiled else "eager"

    def graph(self, phase: str) -> FlatGraph:
        """The flat graph of ``phase`` (``"decode"`` or ``"prefill"``), after the passes when they are on."""
        if phase not in self._graphs:
            self._graphs[phase] = self._traced(phase)
            # make_fx leaves its tracer in reference cycles that hold the traced weights (its root module's
            # constants), as do the graphs the passes replaced: collected now, not whenever the collector runs
            gc.collect()
        return self._graphs[phase]

    def _traced(self, phase: str) -> FlatGraph:
        graph = trace(self.model, self.kernels, phase=phase, block_size=self.block_size, cache_dtype=self.cache_dtype)
        return apply_passes(graph, self.runtime) if self.passes else graph

    def close(self) -> None:
        """Let go of the graphs and their weights (see :meth:`FlatGraph.close`); the model cannot run after it."""
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        self._steps.clear()

    def _step(self, phase: str) -> Callable[..., Any]:
        if phase not in self._steps:
            if self.compiled:
                ops = traceable_ops(self.kernels)
                fn = step_function(self.model, ops, phase, self.model.config.num_layers, StepInputs)
                self._steps[phase] = torch.compile(_own_code(fn), backend=self.backend, fullgraph=True)
            else:
                self._steps[phase] = self.graph(phase)
        return self._steps[phase]

    def _check_caches(self, kv_caches: Sequence[Any]) -> None:
        """Take the caches' dtype for the graphs when none was given and none is traced yet; then refuse caches of
        another dtype than the graphs were traced for: a float8 cache would go through the float cache ops, and a
        float cache through the ``*_fp8`` ones."""
        if not kv_caches:
            return
        cache = kv_caches[0][0]
        if self.cache_dtype is None and not self._graphs and not self._steps:
            self.cache_dtype = cache.dtype
        dtype = self.cache_dtype or self.dtype
        if cache.dtype != dtype:
            raise OpInputError(
                f"FlatModel: its graphs are traced for KV caches of {dtype}, given {cache.dtype}; build it with "
                "FlatModel(..., cache_dtype=) as the cache is (ModelRunner.layout.dtype)"
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[Any], meta: Any) -> Any:
        """Hidden states after the final norm, as ``model.forward`` returns them (``meta.is_decode`` picks the graph)."""
        self._check_caches(kv_caches)
        phase = PHASES[0] if meta.is_decode else PHASES[1]
        with torch.no_grad():
            return self._step(phase)(*graph_inputs(input_ids, positions, kv_caches, meta))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of ``hidden`` (the model's LM head, bound kernels)."""
        return self.model.compute_logits(self.kernels, hidden)

    def decode_step(self, kv_caches: Sequence[Any]) -> Callable[..., torch.Tensor]:
        """``step(input_ids, positions, slot_mapping, block_tables, seq_lens) -> logits`` over ``kv_caches``."""
        self._check_caches(kv_caches)
        run = self._step("decode")
        caches = [t for pair in kv_caches for t in pair]
        cu_seqlens: dict[torch.device, torch.Tensor] = {}

        def step(input_ids, positions, slot_mapping, block_tables, seq_lens):
            n = seq_lens.shape[0]
            if seq_lens.device not in cu_seqlens or cu_seqlens[seq_lens.device].shape[0] < n + 1:
                # decode reads no cu_seqlens_q; one static tensor keeps the step free of allocations
                cu_seqlens[seq_lens.device] = torch.arange(max(n + 1, 2), dtype=torch.int32, device=seq_lens.device)
            cu = cu_seqlens[seq_lens.device][: n + 1]
            with torch.no_grad():
                hidden = run(input_ids, positions, slot_mapping, block_tables, seq_lens, cu, 1, 0, *caches)
                return self.compute_logits(hidden)

        return step

    def capture_decode(
        self,
        kv_caches: Sequence[Any],
        batch_sizes: Sequence[int],
        max_blocks_per_seq: int,
        capture: GraphCapture | None = None,
    ) -> DecodeGraphs:
        """Decode steps over ``kv_caches`` captured at ``batch_sizes`` (see :class:`DecodeGraphs`).

        :param capture: the graph capture to use (default: the platform's).
        :raises ValueError: when the platform has no graph capture and none is given.
        """
        capture = capture or self.runtime.graph_capture()
        if capture is None:
            raise ValueError(
                f"platform {self.runtime.platform.name!r} has no graph capture (PlatformDescription.graph_capture "
                "is False); run decode steps through FlatModel.forward instead"
            )
        device = kv_caches[0][0].device
        step = self.decode_step(kv_caches)
        if self.compiled:  # compile every captured size before capturing: compilation must not be captured
            for size in sorted(set(batch_sizes)):
                self._warm(step, size, max_blocks_per_seq, device)
        return DecodeGraphs(step, capture, batch_sizes, max_blocks_per_seq, device)

    @staticmethod
    def _warm(step: Callable[..., Any], size: int, max_blocks: int, device: torch.device) -> None:
        ids = torch.zeros(size, dtype=torch.int64, device=device)
        slots = torch.full((size,), -1, dtype=torch.int64, device=device)
        tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        step(ids, ids.clone(), slots, tables, torch.zeros(size, dtype=torch.int32, device=device))
