"""The ``vllm_port`` torch.compile backend: fusion passes, a piecewise split at attention, the platform's compiler.

``torch.compile(step, backend="vllm_port")`` (registered through the ``torch_dynamo_backends``
entry point of core) receives the step dynamo captured and:

1. lowers it to the aten level with ``make_fx`` under dynamo's fake mode, so it reads exactly like
   a :class:`~vllm_port.flat.flat_graph.FlatGraph` (contract ops as custom ops, torch ops as aten ops);
2. runs core's fusion passes, then the passes plugins contribute (``vllm_port_graph_passes``);
3. splits the graph at the ops that read the attention metadata (``reshape_and_cache``,
   ``paged_attention``, ``prefill_attention`` and their ``*_fp8`` forms), as vLLM does: those run eagerly, calling their
   providers' plain functions, so block tables and sequence lengths never become compiled-in facts;
4. compiles each piece between them with the platform's compiler: a plugin's own
   (``vllm_port_compile_backend``), else ``PlatformDescription.compile_backend`` (``"inductor"`` on
   CPU and CUDA); ``"none"`` leaves the pieces as traced (a platform with no code generator).

A piece with nothing for a code generator (only contract ops and views, which is every piece of
a Llama-family step once the passes ran) is not handed to the compiler: it runs as traced, each
contract op calling its provider directly, because a compiled piece would call the same kernels
through the custom-op dispatcher and only add its cost. ``compile_trivial=True`` compiles them anyway.

Options (``torch.compile(..., options={...})`` or :func:`make_backend`): ``runtime`` (whose
platform, plugins and bound ops to use; default: ``vllm_port.load()``), ``dtype`` (default: the
dtype the graph's contract ops compute in), ``compiler`` (a dynamo backend name or callable),
``passes`` (``False``: no fusion), ``split`` (``False``: compile the whole graph as one piece),
``compile_trivial`` (see above).
"""

from __future__ import annotations

import functools
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.split_module import split_module

from ..errors import PluginError
from .flat_graph import KV_CACHE_OPS, _named, contract_op, contract_provider, node_kind, op_targets
from .passes import PassContext, core_passes, plugin_passes, run_passes

__all__ = ["SPLIT_OPS", "CompileReport", "VllmPortBackend", "make_backend", "resolve_compiler", "vllm_port_backend"]

#: Contract ops that read the attention metadata; the graph is split around them.
SPLIT_OPS = frozenset(KV_CACHE_OPS)
#: Compiler names that mean "do not compile": the pieces run as traced, each op its provider.
NO_COMPILER = frozenset({"none", "eager"})


@dataclass
class CompileReport:
    """What one compilation by the backend did (the backend keeps them in ``reports``).

    Attributes:
        fusions: times each pass fired.
        pieces: how many pieces were compiled; ``eager_pieces`` how many run eagerly (attention);
            ``trivial_pieces`` how many had nothing to compile (contract ops and views only).
        compiler: the compiler the pieces went to (``"inductor"``, ``"none"``, a callable's name).
        nodes: node count of the lowered graph after the passes.
        seconds: wall time of the whole compilation.
    """

    fusions: dict[str, int] = field(default_factory=dict)
    pieces: int = 0
    eager_pieces: int = 0
    trivial_pieces: int = 0
    compiler: str = ""
    nodes: int = 0
    seconds: float = 0.0


def resolve_compiler(runtime: Any, compiler: str | Callable[..., Any] | None = None) -> str | Callable[..., Any]:
    """The compiler for the pieces: ``compiler`` if given, else the plugin's (``vllm_port_compile_backend``), else the platform's.

    :raises PluginError: naming the plugin whose hook raised or answered something unusable.
    """
    if compiler is not None:
        return compiler
    hook = getattr(runtime.discovery.manager.hook, "vllm_port_compile_backend", None)
    for impl in reversed(hook.get_hookimpls() if hook is not None else []):
        try:
            answer = impl.function(platform=runtime.platform)
        except Exception as exc:
            raise PluginError(
                f"plugin {impl.plugin_name!r}: vllm_port_compile_backend raised {type(exc).__name__}: {exc}"
            ) from exc
        if answer is None:
            continue
        if not (isinstance(answer, str) and answer) and not callable(answer):
            raise PluginError(
                f"plugin {impl.plugin_name!r}: vllm_port_compile_backend returned {answer!r}; return a "
                "torch.compile backend name, a callable (gm, example_inputs) -> callable, or None"
            )
        return answer
    return runtime.platform.compile_backend


def _compiler_name(compiler: str | Callable[..., Any]) -> str:
    return compiler if isinstance(compiler, str) else getattr(compiler, "__name__", type(compiler).__name__)


class VllmPortBackend:
    """A torch.compile backend (``torch.compile(fn, backend=VllmPortBackend(runtime))``); see the module docstring."""

    def __init__(
        self,
        runtime: Any = None,
        dtype: torch.dtype | None = None,
        compiler: str | Callable[..., Any] | None = None,
        passes: bool = True,
        split: bool = True,
        compile_trivial: bool = False,
    ) -> None:
        self.runtime = runtime
        self.dtype = dtype
        self.compiler = compiler
        self.passes = passes
        self.split = split
        self.compile_trivial = compile_trivial
        self.reports: list[CompileReport] = []

    @property
    def __name__(self) -> str:  # torch.compile names a backend after it
        return "vllm_port"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        options = dict(kwargs.get("options") or {})
        unknown = set(options) - {"runtime", "dtype", "compiler", "passes", "split", "compile_trivial"}
        if unknown:
            raise ValueError(
                f"vllm_port backend: unknown options {sorted(unknown)}; it takes runtime, dtype, compiler, passes, "
                "split, compile_trivial"
            )
        start = time.perf_counter()
        runtime = options.get("runtime", self.runtime) or _default_runtime()
        report = CompileReport()
        with torch.no_grad():
            module, fake_mode = lower(gm, example_inputs)
            if options.get("passes", self.passes):
                dtype = options.get("dtype", self.dtype) or _compute_dtype(module)
                kernels = runtime.bind(dtype)
                ctx = PassContext(op_targets(kernels), runtime.platform.name, dtype)
                report.fusions = run_passes(module, ctx, core_passes() + plugin_passes(runtime))
            report.nodes = len(module.graph.nodes)
            compiler = resolve_compiler(runtime, options.get("compiler", self.compiler))
            report.compiler = _compiler_name(compiler)
            split = options.get("split", self.split)
            trivial = options.get("compile_trivial", self.compile_trivial)
            compiled = compile_pieces(module, example_inputs, fake_mode, compiler, split, report, trivial)
        report.seconds = time.perf_counter() - start
        self.reports.append(report)
        return compiled


def make_backend(runtime: Any = None, **options: Any) -> VllmPortBackend:
    """A ``vllm_port`` backend bound to ``runtime`` (and ``dtype``, ``compiler``, ``passes``, ``split``)."""
    return VllmPortBackend(runtime, **options)


@functools.cache
def _default_runtime() -> Any:
    from ..runtime import load

    return load()


#: The backend the ``torch_dynamo_backends`` entry point names: ``torch.compile(fn, backend="vllm_port")``.
vllm_port_backend = VllmPortBackend()


def _compute_dtype(module: fx.GraphModule) -> torch.dtype:
    """The floating dtype the contract ops compute in (the first float input of the first contract node)."""
    for node in module.graph.nodes:
        if contract_op(node) is None:
            continue
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor) and val.is_floating_point():
                return val.dtype
    return torch.get_default_dtype()


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[fx.GraphModule, FakeTensorMode]:
    """Re-trace dynamo's graph to the aten level (contract custom ops kept whole), under dynamo's fake mode."""
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    tracing = "symbolic" if fake_mode.shape_env is not None else "fake"
    with fake_mode:
        module = make_fx(gm, tracing_mode=tracing, _allow_non_fake_inputs=True)(*fake_inputs)
    return module, fake_mode


def _splits(node: fx.Node) -> bool:
    return contract_op(node) in SPLIT_OPS


def _is_cheap(node: fx.Node) -> bool:
    """Nodes that launch no kernel (views, getitem, size arithmetic): they may join an eager piece."""
    if node.op != "call_function" or node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return not isinstance(node.meta.get("val"), torch.Tensor)  # operator.* on sizes, getitem
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) or node.target in (
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_numel.default,
    )


def partition(module: fx.GraphModule) -> tuple[dict[fx.Node, int], set[int]]:
    """Piece number of every node, and the pieces that run eagerly (attention).

    A run of split ops, with the views between them (``q.view(...)`` after the cache write), is
    one eager piece; everything between two such runs is one compiled piece.
    """
    piece, eager, in_eager = 0, set(), False
    ids: dict[fx.Node, int] = {}
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if _splits(node):
            if not in_eager:
                piece += 1
                in_eager = True
                eager.add(piece)
        elif in_eager and not _is_cheap(node):
            piece += 1
            in_eager = False
        ids[node] = piece
    return ids, eager


class _Compiled(torch.nn.Module):
    """Holds a compiled piece where the split module expects a submodule."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def compile_pieces(
    module: fx.GraphModule,
    example_inputs: Sequence[Any],
    fake_mode: FakeTensorMode,
    compiler: str | Callable[..., Any],
    split: bool,
    report: CompileReport,
    compile_trivial: bool = False,
) -> Callable[..., Any]:
    """Split ``module`` at attention and compile the pieces between with ``compiler``; return the callable."""
    if not split:
        report.pieces = 1
        return _compile_one(module, list(example_inputs), fake_mode, compiler)
    ids, eager = partition(module)
    split_gm = split_module(module, None, lambda node: ids[node], keep_original_order=True)
    eager_names = {f"submod_{i}" for i in eager}
    report.eager_pieces = len(eager_names)
    others = {n for n, _ in split_gm.named_children() if n not in eager_names}
    compile_now = {n for n in others if compile_trivial or _has_codegen_work(getattr(split_gm, n))}
    eager_names |= others - compile_now  # nothing to generate: run as traced, providers called directly
    report.trivial_pieces = len(others - compile_now)
    report.pieces = len(compile_now)
    if isinstance(compiler, str) and compiler in NO_COMPILER:
        for piece in split_gm.children():
            _call_providers_directly(piece)
        return split_gm

    class Pieces(torch.fx.Interpreter):
        """Runs the split graph on fake inputs; each piece is compiled for the inputs it gets."""

        def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
            out = super().call_module(target, args, kwargs)
            if target in compile_now:
                piece = getattr(split_gm, target)
                compiled = _compile_one(piece, list(args), fake_mode, compiler)
                delattr(split_gm, target)
                setattr(split_gm, target, _Compiled(compiled))
            return out

    if compile_now:
        fake_inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        with fake_mode:
            Pieces(split_gm).run(*fake_inputs)
    for name in eager_names:  # after the fake run: providers' own code may read values (a host sync on CPU)
        _call_providers_directly(getattr(split_gm, name))
    return split_gm


def _has_codegen_work(piece: fx.GraphModule) -> bool:
    """Whether a piece holds a torch op a code generator could fuse or specialise (not a view, not a size)."""
    for node in piece.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or contract_op(node) is not None:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            if isinstance(node.meta.get("val"), torch.Tensor):
                return True  # a Python-level tensor function: leave it to the compiler
            continue  # size arithmetic
        if node_kind(node) == "shape" or any(r.alias_info is not None for r in schema.returns):
            continue
        return True
    return False


def _compile_one(
    piece: fx.GraphModule, args: list[Any], fake_mode: FakeTensorMode, compiler: str | Callable[..., Any]
) -> Callable[..., Any]:
    if isinstance(compiler, str):
        if compiler in NO_COMPILER:
            _call_providers_directly(piece)
            return piece
        from torch._dynamo.backends.registry import lookup_backend

        compiler = lookup_backend(compiler)
    output = next(n for n in reversed(piece.graph.nodes) if n.op == "output")
    if isinstance(output.args[0], (tuple, list)):
        return compiler(piece, args)
    output.args = ((output.args[0],),)  # compilers built on AOTAutograd want tuple outputs
    piece.recompile()
    compiled = compiler(piece, args)

    def first(*inputs: Any) -> Any:
        return compiled(*inputs)[0]

    return first


def _call_providers_directly(piece: fx.GraphModule) -> None:
    """Make a piece that runs eagerly call each contract op's provider function, not its custom-op wrapper."""
    for node in piece.graph.nodes:
        chosen = contract_provider(node)
        if chosen is not None and not isinstance(chosen.fn, torch._ops.OpOverload):
            node.target = _named(chosen)
    piece.recompile()
