"""``VLLM_BRIDGE_KEEP``: leave named parts of the model on vLLM's own kernels, to measure the bridge part by part.

The bridge routes every part it knows by default. To find where time goes, a run may name parts
that stay vLLM's: ``VLLM_BRIDGE_KEEP=attention`` runs vLLM's attention backend beside the
bridged norms, rotary and activations; ``VLLM_BRIDGE_KEEP=RMSNorm,RotaryEmbedding`` the
reverse for those layers. Never silent: :func:`kept_parts` refuses an unknown name, and
:func:`vllm_port_vllm.register` logs a warning naming what it left to vLLM (``VLLM_PORT_STATS``
shows the kept parts' ops with no calls). The name is outside ``VLLM_PORT_*`` on purpose: the runtime,
strict inside vLLM, refuses any setting of that prefix that core does not know, and this one is the
bridge's alone.
"""

from __future__ import annotations

import os

from .errors import BridgeError

__all__ = ["KEEP_ENV", "PARTS", "kept_parts"]

KEEP_ENV = "VLLM_BRIDGE_KEEP"
#: the parts a run may keep on vLLM: the bridged layer classes (``RotaryEmbedding``: every rope class), attention,
#: the FP8 linear layers and the mixture-of-experts layers
PARTS = ("RMSNorm", "SiluAndMul", "GeluAndMul", "RotaryEmbedding", "attention", "fp8_linear", "fused_moe")


def kept_parts(value: str | None = None) -> frozenset[str]:
    """The parts named by ``value`` (default: ``$VLLM_BRIDGE_KEEP``), comma-separated; empty when unset.

    :raises BridgeError: for a name that is not one of :data:`PARTS`.
    """
    value = os.environ.get(KEEP_ENV, "") if value is None else value
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        raise BridgeError(
            f"vllm-port bridge: {KEEP_ENV}={value!r} names {', '.join(map(repr, unknown))}, which the bridge does "
            f"not route; it can keep on vLLM's kernels: {', '.join(PARTS)}"
        )
    return frozenset(names)
