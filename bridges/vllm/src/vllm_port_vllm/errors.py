"""The one exception the bridge raises: vLLM must not start on kernels nobody vouched for."""

from __future__ import annotations

from vllm_port.errors import VllmPortError

__all__ = ["BridgeError"]


class BridgeError(VllmPortError, RuntimeError):
    """The bridge refuses to run: an unknown vLLM version or layer signature, a broken or uncertified plugin.

    The message names what was refused and how to fix it. The bridge never falls back to vLLM's own
    kernels in silence: a refusal stops vLLM at start.
    """
