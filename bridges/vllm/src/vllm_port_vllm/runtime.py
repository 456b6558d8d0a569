"""The bridge's runtime: discovered, selected, certified and bound once per vLLM process.

Discovery and selection are this project's own (``VLLM_PORT_PLUGINS``, ``VLLM_PORT_DEVICE``
apply), in strict mode: a plugin that fails to load or a provider refused at registration stops
the bridge. The selected plugin must be certified (:mod:`vllm_port_vllm.certificate`). The provider
bound to each bridged op is smoke-checked against the float64 reference, and one that fails stops the bridge, so a
bridged op is served by the provider the certificate covers or vLLM does not start; where the platform has no provider of an op the bridge
routes, the reference would serve it: that is refused as well, naming the op.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from vllm_port.errors import VllmPortError
from vllm_port.ops import REFERENCE, BoundOps
from vllm_port.ops.debug import smoke_check
from vllm_port.runtime import Runtime

from .certificate import check_certificate
from .errors import BridgeError

__all__ = ["BRIDGED_OPS", "ON_DEMAND_OPS", "Bridge", "bridge", "kernels", "prepare", "reset"]

#: The contract ops the bridge routes vLLM's layers to.
BRIDGED_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_and_mul",
    "reshape_and_cache",
    "prefill_attention",
    "paged_attention",
)

#: Ops routed only where the model has the layer (an FP8 linear, a mixture of experts), checked when vLLM builds one
#: (:meth:`Bridge.require`); each is also the name of the part ``VLLM_BRIDGE_KEEP`` leaves on vLLM's kernels.
ON_DEMAND_OPS = ("fp8_linear", "fused_moe")

_lock = threading.Lock()
_bridge: Bridge | None = None
_eager: dict[torch.dtype, BoundOps] = {}
_traced: dict[torch.dtype, BoundOps] = {}


class Bridge:
    """The selected, certified platform and its bound ops per dtype (``kernels(torch.bfloat16)``).

    Attributes:
        runtime: the vllm-port runtime (discovery, selection).
        certificate: the certification report that admitted the plugin.
    """

    def __init__(self, runtime: Runtime, certificate: dict[str, Any]) -> None:
        self.runtime = runtime
        self.certificate = certificate
        self._bound: dict[torch.dtype, BoundOps] = {}
        self._required: set[tuple[torch.dtype, str]] = set()  # (dtype, op) checked by require()

    @property
    def plugin(self) -> str:
        """The selected plugin's name."""
        return self.runtime.selected.name

    def kernels(self, dtype: torch.dtype) -> BoundOps:
        """The ops bound for ``dtype`` (bound on first use, smoke-checked, strict).

        :raises BridgeError: when binding falls back, a provider fails its smoke check, or the
            reference would serve an op the bridge routes.
        """
        bound = self._bound.get(dtype)
        if bound is None:
            with _lock:
                bound = self._bound.get(dtype) or self._bind(dtype)
                self._bound[dtype] = bound
        return bound

    def _bind(self, dtype: torch.dtype) -> BoundOps:
        # Smoke-checked and refused here for the ops the bridge routes only: vLLM runs its own sampler,
        # embedding and linear layers, so a plugin's trouble with those is not the bridge's to refuse.
        try:
            bound = self.runtime.bind(dtype, strict=False)
        except VllmPortError as exc:
            raise BridgeError(f"vllm-port bridge: plugin {self.plugin!r} cannot serve {dtype} in vLLM: {exc}") from exc
        self._refuse_unsound(bound, dtype, BRIDGED_OPS)
        return bound

    def require(self, dtype: torch.dtype, ops: tuple[str, ...]) -> None:
        """Check ``ops`` as :meth:`kernels` checks the layers' ops, for parts a model may not have (FP8 layers).

        :raises BridgeError: as :meth:`kernels` does, for these ops.
        """
        todo = tuple(op for op in ops if (dtype, op) not in self._required)
        if todo:
            bound = self.kernels(dtype)
            with _lock:
                self._refuse_unsound(bound, dtype, todo)
                self._required.update((dtype, op) for op in todo)

    def _refuse_unsound(self, bound: BoundOps, dtype: torch.dtype, ops: tuple[str, ...]) -> None:
        failed = []
        for name in ops:
            chosen = bound.providers[name]
            raw = next(  # the registered provider, not the VLLM_PORT_STATS counter around it: checks are not calls
                p for p in self.runtime.registry.candidates(name) if (p.name, p.plugin) == (chosen.name, chosen.plugin)
            )
            problem = smoke_check(self.runtime.registry.ops[name], raw, dtype, self.runtime.device)
            if problem:
                failed.append(f"{name}: provider {raw.name!r} of plugin {raw.plugin!r} fails its smoke check {problem}")
        if failed:
            raise BridgeError(
                f"vllm-port bridge: plugin {self.plugin!r} cannot serve {dtype} in vLLM: {'; '.join(failed)}. The "
                "bridge runs only providers that pass: fix them (vllm-port doctor shows each check)"
            )
        uncovered = [op for op in ops if bound.providers[op].name == REFERENCE]
        if uncovered:
            otherwise = (
                f"keep these layers on vLLM's kernels with VLLM_BRIDGE_KEEP={','.join(uncovered)}"
                if set(uncovered) <= set(ON_DEMAND_OPS)
                else "run vLLM without the bridge: pip uninstall vllm-port-vllm"
            )
            raise BridgeError(
                f"vllm-port bridge: plugin {self.plugin!r} has no provider for {', '.join(uncovered)} in {dtype}, so "
                f"vllm-port's reference would run there; give the plugin providers for them (or {otherwise})"
            )

    def traced(self, dtype: torch.dtype) -> BoundOps:
        """The ops of :meth:`kernels` as custom ops, for ``torch.compile`` (the same providers for the layers' ops;
        an on-demand op's are compared by :func:`prepare` when a model asks for it)."""
        eager = self.kernels(dtype)
        traced = self.runtime.bind(dtype, traceable=True, strict=False)
        _refuse_moved(eager, traced, BRIDGED_OPS)
        return traced


def _refuse_moved(eager: BoundOps, traced: BoundOps, ops: tuple[str, ...]) -> None:
    """Refuse a binding for ``torch.compile`` that chose other providers than the eager one for ``ops``."""
    moved = [op for op in ops if traced.providers[op].name != eager.providers[op].name]
    if moved:
        raise BridgeError(f"vllm-port bridge: binding for torch.compile chose other providers for {', '.join(moved)}")


def bridge() -> Bridge:
    """This process's bridge, loaded on first call.

    :raises BridgeError: for a broken plugin (naming it and why), no available platform, or no valid certificate.
    """
    global _bridge
    if _bridge is None:
        with _lock:
            if _bridge is None:
                _bridge = _load()
    return _bridge


def _load() -> Bridge:
    from vllm_port.discovery import discover
    from vllm_port.runtime import select

    try:
        discovery = discover(strict=True)
    except VllmPortError as exc:
        raise BridgeError(
            f"vllm-port bridge: a plugin is broken, and the bridge runs only where every plugin it loads is sound "
            f"(it is always strict: fix the plugin, or deny it with VLLM_PORT_PLUGINS=-NAME): {exc}"
        ) from exc
    try:
        selected, reason = select(discovery)
    except VllmPortError as exc:
        raise BridgeError(f"vllm-port bridge: no plugin's platform can run here: {exc}") from exc
    certificate = check_certificate(selected)
    return Bridge(Runtime(discovery, selected, reason), certificate)


def prepare(dtype: torch.dtype, ops: tuple[str, ...] = ()) -> None:
    """Bind ``dtype`` for eager calls and for tracing (strict, smoke-checked: :meth:`Bridge.kernels`), and check
    ``ops`` beyond the layers' (:meth:`Bridge.require`: an FP8 layer's ``fp8_linear``).

    vLLM's layers call this when they are built, so that tracing later only reads a dict.
    """
    b = bridge()
    if ops:
        b.require(dtype, ops)
    if dtype not in _eager:
        _eager[dtype] = b.kernels(dtype)
        _traced[dtype] = b.traced(dtype)
    _refuse_moved(_eager[dtype], _traced[dtype], ops)


def kernels(dtype: torch.dtype) -> BoundOps:
    """The bound ops for ``dtype``: their custom ops while ``torch.compile`` traces, the functions otherwise."""
    if torch.compiler.is_compiling():
        return _traced[dtype]
    bound = _eager.get(dtype)
    if bound is None:
        prepare(dtype)
        bound = _eager[dtype]
    return bound


def reset() -> None:
    """Forget this process's bridge and bindings (tests)."""
    global _bridge
    _bridge = None
    _eager.clear()
    _traced.clear()
