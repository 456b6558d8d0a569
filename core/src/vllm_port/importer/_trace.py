"""Trace one piece of a ``transformers`` model (the embedding, a decoder layer, the final norm, the LM head) to fx.

Why pieces and not the whole model: a ``transformers`` causal LM's top-level ``forward`` builds
attention masks from the batch, grows a ``DynamicCache`` and reads ``config`` flags, all of which
is Python over sizes and host state that a paged engine replaces anyway. One decoder layer is
plain tensor code once two things are pinned down: ``cache=None`` (nothing is cached by the
model), and attention through transformers' own seam, the ``AttentionInterface``: the importer
registers an implementation, ``"vllm_port_import"``, whose body is one opaque custom op
(``vllm_port_import::attention``). The layer's q/k/v projections, rotary embedding, norms and MLP
then trace to a small aten graph, and attention is one node whose inputs are the rotated queries,
keys and values. The rewrite (``_rewrite.py``) replaces that node with the paged KV cache.

The tracer is ``make_fx`` in pre-dispatch mode with the token dimension symbolic: pre-dispatch
keeps ``aten.linear``, ``aten.silu`` and friends as single nodes (what the patterns match), and the
symbolic token count makes every view in the graph (``view(1, T, -1, head_dim)``) valid for any
batch, so what stays native runs at every step.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, SLoc, StatelessSymbolicContext

from ..errors import VllmPortError

__all__ = ["ATTENTION_IMPLEMENTATION", "ImporterError", "attention_seam", "trace_piece"]


class ImporterError(VllmPortError):
    """A ``transformers`` model cannot be imported; the message names the model, the piece and what to do."""


#: The name the importer's attention implementation is registered under in transformers' AttentionInterface.
ATTENTION_IMPLEMENTATION = "vllm_port_import"
#: The example token count the pieces are traced at (symbolic; any count runs). Odd and > 1 so no
#: size coincides with it by chance and torch does not specialise it (it specialises 0 and 1).
EXAMPLE_TOKENS = 13


@torch.library.custom_op("vllm_port_import::attention", mutates_args=())
def attention_marker(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, sliding_window: int, soft_cap: float
) -> torch.Tensor:
    """Where a traced layer attends: ``query [B, H, S, D]``, ``key``/``value [B, KV, S, D]`` -> ``[B, S, H, D]``.

    Only ever traced, then replaced by the paged cache's ops. Run eagerly (a graph used before its
    rewrite), it is causal attention over the given keys, so nothing silently computes garbage.
    """
    groups = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    seq = query.shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
    if sliding_window > 0:
        mask &= ~torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril(-sliding_window)
    scores = (query.float() @ k.float().transpose(-1, -2)) * scaling
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v.float()).to(query.dtype).transpose(1, 2).contiguous()


@attention_marker.register_fake
def _attention_fake(query, key, value, scaling, sliding_window, soft_cap):
    b, h, s, _ = query.shape
    return query.new_empty((b, s, h, value.shape[-1]))


#: Attention-function keyword arguments that do not change what attention computes here.
_HARMLESS_KWARGS = {"position_ids", "use_cache", "cache_position", "output_attentions", "layer_idx", "is_causal"}


def _attention_function(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The importer's ``AttentionInterface`` implementation: the marker op, refusing what it cannot honour."""
    who = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    unknown = sorted(k for k, v in kwargs.items() if k not in _HARMLESS_KWARGS and v is not None)
    if unknown:
        raise ImporterError(
            f"{who} passes {', '.join(unknown)} to its attention function; the paged attention ops have no such "
            "input, so this model's attention cannot be imported (supported: scaling, sliding_window, softcap)"
        )
    if kwargs.get("is_causal") is False:
        raise ImporterError(
            f"{who} asks for non-causal (bidirectional) attention; the paged attention ops are causal, so only "
            "causal LMs' decoders can be imported. Load the model's causal-LM class (AutoModelForCausalLM) with "
            "causal attention, or run this model with transformers itself"
        )
    if dropout and module.training:
        raise ImporterError(f"{who} is in training mode with attention dropout {dropout}; call model.eval() first")
    if attention_mask is not None:
        raise ImporterError(
            f"{who} received an attention mask while tracing; the importer traces layers with attention_mask=None "
            "and a model that builds its own mask inside a layer is not supported"
        )
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = attention_marker(query, key, value, scale, int(sliding_window or 0), float(softcap or 0.0))
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, _attention_function)


@contextlib.contextmanager
def attention_seam(model: torch.nn.Module) -> Iterator[None]:
    """Route ``model``'s attention through the importer's implementation while tracing; restore it after."""
    _register()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "__dict__")}
    saved = {key: getattr(c, "_attn_implementation_internal", None) for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTENTION_IMPLEMENTATION
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation_internal = saved[key]  # as it was, bypassing the setter's checks


def trace_piece(
    fn: Callable[..., Any], inputs: Sequence[tuple[str, torch.Tensor, Sequence[bool]]], who: str
) -> fx.GraphModule:
    """``fn`` traced at the aten pre-dispatch level over fake inputs whose marked dimensions are symbolic.

    :param inputs: ``(name, example, dynamic)`` per argument: an example tensor (its values unused)
        and which of its dimensions are symbolic (the token count).
    :param who: the piece, for the error (``"LlamaForCausalLM layer 3"``).
    :raises ImporterError: when ``fn`` cannot be traced, or its graph holds for some token counts only
        (a Python branch on a size), naming the piece, the cause and the fix.
    """
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    args = []
    for name, example, dynamic in inputs:
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic],
            constraint_sizes=[None] * example.dim(),
        )
        args.append(mode.from_tensor(example, symbolic_context=context, source=ConstantSource(name)))
    try:
        with torch.no_grad():
            gm = make_fx(fn, tracing_mode="symbolic", pre_dispatch=True, _allow_non_fake_inputs=True)(*args)
    except ImporterError:
        raise
    except Exception as exc:
        raise ImporterError(
            f"{who} could not be traced: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "The importer traces each piece symbolically: its forward must be tensor code without host reads of "
            "tensor values (.item(), .tolist(), Python branches on values); rewrite that part, or run the model "
            "with transformers itself"
        ) from exc
    _refuse_size_guards(shape_env, who)
    return gm


def _refuse_size_guards(shape_env: ShapeEnv, who: str) -> None:
    """Refuse a trace that holds for some token counts only.

    While tracing, every Python decision on a symbolic size (``if x.shape[1] > 20``) is recorded
    as a guard and the graph follows the branch taken at the example count: run at a count where
    the guard fails, it computes the other branch's result silently. The only guards a plain piece
    leaves are equalities between its inputs' token counts (``hidden``, ``cos`` and ``sin`` have
    the same number of tokens), true of every call the engine makes.
    """
    tokens = sympy.Symbol("tokens")
    for guard in shape_env.guards:
        expr = guard.expr
        if isinstance(expr, sympy.Eq) and all(isinstance(side, sympy.Symbol) for side in expr.args):
            continue
        condition = expr.xreplace({symbol: tokens for symbol in expr.free_symbols})
        raise ImporterError(
            f"{who} branches on its token count: traced at {EXAMPLE_TOKENS} tokens, its graph holds only while "
            f"`{condition}` (recorded at {_location(guard.sloc)}), and at other token counts it would compute the "
            "other branch's result silently. The importer runs every piece at any token count: make that code "
            "independent of the sequence length (compute both results and select with torch.where, or branch on "
            "a config value instead of a size), or run this model with transformers itself (the importer cannot "
            "leave a module untraced)"
        )


def _location(sloc: SLoc) -> str:
    """Where a guard was recorded: ``file:line in function: source text`` when known."""
    if sloc.maybe_user_loc:
        return sloc.maybe_user_loc
    frame = sloc.framework_loc
    if isinstance(frame, traceback.FrameSummary):
        where = f"{frame.filename}:{frame.lineno} in {frame.name}"
        return f"{where}: {frame.line.strip()}" if frame.line else where
    return str(frame or "an unknown place")
