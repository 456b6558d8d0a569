"""A vLLM platform described from the selected plugin's ``PlatformDescription`` (``vllm.platform_plugins``).

vLLM asks each platform plugin whether its platform is present. Where the selected vllm-port
platform runs on a device type vLLM already knows (``cpu``, ``cuda``, ``hip``/``rocm``, ``xpu``,
``tpu``), :func:`activate` answers ``None`` and vLLM's own platform stays, with the general
plugin routing its kernels. For any other device type it answers :class:`VllmPortPlatform`: the
device type, name and distributed backend from the plugin's description, memory totals from the
plugin's allocator, and the bridge's attention backend. That is what the contracts can say; what a
new accelerator still needs from vLLM itself (a worker and model runner for its device, a
communicator class, graph capture) is in docs/vendor-guide.md, "Running inside vLLM".
"""

from __future__ import annotations

from typing import Any

__all__ = ["KNOWN_DEVICE_TYPES", "activate"]  # and VllmPortPlatform, built on first access (module __getattr__)

#: device types vLLM has platforms of its own for
KNOWN_DEVICE_TYPES = frozenset({"cpu", "cuda", "hip", "rocm", "xpu", "tpu"})


def activate() -> str | None:
    """vLLM's platform-plugin hook: the class path of :class:`VllmPortPlatform`, or ``None`` where vLLM knows the device."""
    from .runtime import bridge

    platform = bridge().runtime.platform
    if platform.device_type in KNOWN_DEVICE_TYPES:
        return None
    return f"{__name__}.VllmPortPlatform"


def _platform_base() -> type:
    from vllm.platforms.interface import Platform, PlatformEnum

    class Base(Platform):
        _enum = PlatformEnum.OOT

    return Base


def __getattr__(name: str) -> Any:  # the class is built when vLLM resolves it, with vLLM imported
    if name != "VllmPortPlatform":
        raise AttributeError(name)
    from .runtime import bridge

    runtime = bridge().runtime
    description = runtime.platform
    probe = runtime.selected.probe
    devices = probe.devices if probe is not None else ()

    def get_device_name(cls: type, device_id: int = 0) -> str:
        return devices[device_id].name if device_id < len(devices) else description.name

    def get_device_total_memory(cls: type, device_id: int = 0) -> int:
        return int(runtime.allocator().mem_info()[1])

    def get_attn_backend_cls(cls: type, *args: Any, **kwargs: Any) -> str:
        return "vllm_port_vllm.attention.VllmPortAttentionBackend"

    cls = type(
        "VllmPortPlatform",
        (_platform_base(),),
        {
            "__module__": __name__,
            "__doc__": f"vLLM's view of vllm-port platform {description.name!r} (plugin {runtime.selected.name!r}).",
            "device_name": description.name,
            "device_type": description.device_type,
            "dispatch_key": "PrivateUse1",
            "dist_backend": description.dist_backend,
            "get_device_name": classmethod(get_device_name),
            "get_device_total_memory": classmethod(get_device_total_memory),
            "get_attn_backend_cls": classmethod(get_attn_backend_cls),
        },
    )
    globals()["VllmPortPlatform"] = cls
    return cls
