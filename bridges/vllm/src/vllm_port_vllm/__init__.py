"""The vLLM bridge: a certified vllm-port plugin's kernels inside an unmodified vLLM.

vLLM calls :func:`register` (the ``vllm.general_plugins`` entry point ``vllm_port``) in each of
its processes before it builds a model. It checks vLLM's version and the signatures of the layers
it replaces (:mod:`vllm_port_vllm.compat`), loads this project's runtime (discovery, selection,
the plugin's certificate: :mod:`vllm_port_vllm.runtime`), and routes vLLM's norms, rotary
embeddings and gated activations (:mod:`vllm_port_vllm.layers`) and its decoder attention
(:mod:`vllm_port_vllm.attention`), its FP8 linear layers (:mod:`vllm_port_vllm.fp8`) and its mixture-of-experts
layers (:mod:`vllm_port_vllm.moe`) to the bound providers. Any of these failing stops vLLM with a
:class:`~vllm_port_vllm.errors.BridgeError` that names it: the bridge never lets vLLM fall back to
its own kernels in silence.

This module imports nothing at import time, so that a broken installation fails inside
:func:`register` (which vLLM lets raise) rather than while vLLM loads the entry point (which vLLM
only logs).
"""

from __future__ import annotations

__all__ = ["register"]

_registered: list[str] = []


def register() -> None:
    """Bridge this vLLM process to the selected certified plugin (vLLM's general-plugin hook).

    :raises vllm_port_vllm.errors.BridgeError: for an unknown vLLM version or layer signature, a
        broken plugin, or a plugin without a valid certificate.
    """
    if _registered:
        return
    import logging

    from .attention import register_attention
    from .compat import check_vllm
    from .fp8 import register_fp8
    from .keep import KEEP_ENV, kept_parts
    from .layers import register_layers
    from .moe import register_moe
    from .runtime import bridge

    check_vllm()
    kept = kept_parts()
    b = bridge()
    layers = register_layers(keep=kept)
    backends = [] if "attention" in kept else register_attention()
    layers += [] if "fp8_linear" in kept else register_fp8()
    layers += [] if "fused_moe" in kept else register_moe()
    _registered.extend(layers + backends)
    log = logging.getLogger("vllm_port_vllm")
    if kept:
        log.warning("vllm-port bridge: %s=%s: these parts run on vLLM's own kernels", KEEP_ENV, ",".join(sorted(kept)))
    log.info(
        "vllm-port bridge: plugin %r (certified, %s) serves %s; attention backends %s",
        b.plugin,
        b.certificate.get("source", {}).get("sha256", "?")[:12],
        ", ".join(layers),
        ", ".join(backends),
    )
