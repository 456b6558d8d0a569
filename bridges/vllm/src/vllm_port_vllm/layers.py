"""vLLM's layers on the bound providers: norms, rotary embeddings, gated activations.

Each bridged layer is a subclass of vLLM's own class registered with ``CustomOp.register_oot``
under the class's name, so vLLM builds it wherever it would build its own. Every ``forward_*``
method (``forward_native`` included: under ``torch.compile`` vLLM's default ``custom_ops`` makes
every CustomOp run it) calls the bound provider, so eager and compiled runs take the same kernel.

Eagerly the layer calls the bound function itself (one attribute load); while ``torch.compile``
traces, it calls the provider's custom op (``Runtime.bind(traceable=True)``), which the graph
keeps as one opaque node with the op's fake implementation.

Rotary: every class vLLM's ``get_rope`` may build that keeps ``RotaryEmbedding``'s rotation and
only computes its own cos/sin table (plain, Llama 3, linear, NTK, dynamic NTK, YaRN scaling) is
bridged; the others (mrope, DeepSeek, Phi-3 long rope...) rotate differently, and a model that
builds one is refused by name rather than run on vLLM's kernel in silence.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .errors import BridgeError
from .runtime import kernels as _kernels
from .runtime import prepare as _prepare

__all__ = ["BRIDGED_LAYERS", "bridged_rotary_classes", "register_layers", "unbridged_rotary_classes"]

#: vLLM classes the bridge replaces, by name, with the contract ops they run.
BRIDGED_LAYERS = {
    "RMSNorm": ("rms_norm", "fused_add_rms_norm"),
    "SiluAndMul": ("silu_and_mul",),
    "GeluAndMul": ("gelu_and_mul",),
    "RotaryEmbedding": ("rotary_embedding",),
}

_FORWARDS = (
    "forward_native",
    "forward_cuda",
    "forward_hip",
    "forward_cpu",
    "forward_xpu",
    "forward_tpu",
    "forward_oot",
)


def _with_forwards(name: str, base: type, body: dict[str, Any]) -> type:
    forward = body["forward_native"]
    namespace = {**body, **{f: forward for f in _FORWARDS}, "__module__": __name__, "__qualname__": f"VllmPort{name}"}
    return type(f"VllmPort{name}", (base,), namespace)


def _norm_class(base: type) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        if self.variance_size_override is not None:
            raise BridgeError(
                f"vllm-port bridge: RMSNorm(hidden_size={self.hidden_size}, var_hidden_size="
                f"{self.variance_size_override}) normalises over part of the row, which rms_norm does not; "
                "this model cannot run on the bridge (pip uninstall vllm-port-vllm to run it on vLLM's kernels)"
            )
        _prepare(self.weight.dtype)

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        kernels = _kernels(x.dtype)
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.variance_epsilon)
        out = kernels.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        return out, residual  # the op added x into residual in place

    return _with_forwards("RMSNorm", base, {"__init__": init, "forward_native": forward_native})


def _silu_class(base: type) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        _prepare(torch.get_default_dtype())  # vLLM builds the model under its dtype

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _kernels(x.dtype).silu_and_mul(x)

    return _with_forwards("SiluAndMul", base, {"__init__": init, "forward_native": forward_native})


def _gelu_class(base: type) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        _prepare(torch.get_default_dtype())

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _kernels(x.dtype).gelu_and_mul(x, self.approximate)

    return _with_forwards("GeluAndMul", base, {"__init__": init, "forward_native": forward_native})


def _rotary_class(base: type) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        width = self.cos_sin_cache.shape[-1]
        if width != self.rotary_dim or self.rotary_dim > self.head_size:
            raise BridgeError(
                f"vllm-port bridge: {base.__name__} built a cos/sin table of {width} columns for rotary_dim "
                f"{self.rotary_dim} and head_size {self.head_size}; rotary_embedding takes [max_position, rotary_dim]"
            )
        _prepare(self.dtype)

    def forward_native(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if key is None:
            raise BridgeError(
                f"vllm-port bridge: {base.__name__} was called without a key (cross-layer KV sharing); "
                "rotary_embedding rotates a query and a key together"
            )
        cache = self._match_cos_sin_cache_dtype(query)
        _kernels(query.dtype).rotary_embedding(
            positions.flatten(), query, key, self.head_size, cache, self.is_neox_style
        )
        return query, key  # rotated in place

    return _with_forwards(base.__name__, base, {"__init__": init, "forward_native": forward_native})


def _refusing_class(base: type) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        raise BridgeError(
            f"vllm-port bridge: this model builds {base.__module__}.{base.__name__}, a rotary embedding that "
            "rotates differently from vLLM's RotaryEmbedding, and no contract op covers it, so it would run on "
            "vLLM's own kernel; the bridge refuses instead. Run this model without the bridge "
            "(pip uninstall vllm-port-vllm), or ask for the op in vllm-port"
        )

    return type(f"VllmPortRefused{base.__name__}", (base,), {"__init__": init, "__module__": __name__})


def _rotary_subclasses() -> list[type]:
    import importlib
    import pkgutil

    import vllm.model_executor.layers.rotary_embedding as package
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    for info in pkgutil.iter_modules(package.__path__):  # every rope class vLLM ships, imported so it is seen
        importlib.import_module(f"{package.__name__}.{info.name}")
    found, todo = [], [RotaryEmbeddingBase]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("vllm.") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: c.__name__)


def _rotates_as_base(cls: type) -> bool:
    """Whether ``cls`` keeps RotaryEmbedding's rotation and differs only in its cos/sin table."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    if not issubclass(cls, RotaryEmbedding):
        return False
    same = ("forward", "forward_static", *_FORWARDS, "_match_cos_sin_cache_dtype")
    return all(inspect.getattr_static(cls, f, None) is inspect.getattr_static(RotaryEmbedding, f, None) for f in same)


def bridged_rotary_classes() -> list[type]:
    """vLLM's rope classes the bridge runs on ``rotary_embedding``."""
    return [c for c in _rotary_subclasses() if _rotates_as_base(c)]


def unbridged_rotary_classes() -> list[type]:
    """vLLM's rope classes the bridge refuses to build (they rotate differently)."""
    return [c for c in _rotary_subclasses() if not _rotates_as_base(c)]


def register_layers(keep: frozenset[str] = frozenset()) -> list[str]:
    """Register the bridged layers with vLLM (``CustomOp.register_oot``); return the class names replaced.

    ``keep``: layers left to vLLM (:mod:`vllm_port_vllm.keep`; ``RotaryEmbedding`` keeps every rope
    class). Once per process; a second call registers nothing.
    """
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    made = {
        "RMSNorm": _norm_class(RMSNorm),
        "SiluAndMul": _silu_class(SiluAndMul),
        "GeluAndMul": _gelu_class(GeluAndMul),
    }
    made = {name: cls for name, cls in made.items() if name not in keep}
    if "RotaryEmbedding" not in keep:
        for cls in bridged_rotary_classes():
            made[cls.__name__] = _rotary_class(cls)
        for cls in unbridged_rotary_classes():
            made.setdefault(cls.__name__, _refusing_class(cls))
    for name, cls in made.items():
        if name not in op_registry_oot:
            CustomOp.register_oot(cls, name=name)
    return sorted(made)
