"""The contracts between core and vendor plugins, as pluggy hook specs.

Every hook is documented to one template: what it is for, its parameters, what it returns, and the
calling rule. Core calls each plugin's implementation on its own, so that one broken plugin is
recorded by name and skipped while the rest keep working. Hooks are called only while plugins are
discovered and bound, never on the path of a kernel launch.

A plugin is a module (or object) with ``@vllm_port.hookimpl`` functions, named in an entry point of
group ``vllm_port``. It must implement ``vllm_port_api_range``; a platform plugin also implements
``vllm_port_platform_describe`` and ``vllm_port_platform_probe``. Every other hook is optional.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .comm import Collectives, PointToPoint
    from .graph import GraphCapture
    from .memory import Allocator, BlockPoolFactory, Migrator
    from .ops import Provider
    from .platform import PlatformDescription, ProbeResult

PROJECT = "vllm_port"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

# -------------------------------------------------------------------------------------------------
# Identity and versioning
# -------------------------------------------------------------------------------------------------


@hookspec
def vllm_port_api_range() -> str:
    """Say which versions of the contract API this plugin implements.

    :return: a range such as ``">=1.0,<2"`` (see :mod:`vllm_port.api`). Core refuses the plugin,
        naming the plugin, its range and core's ``API_VERSION``, when the range excludes it.

    Calling rule: required of every plugin; called once per plugin, before any other hook.
    """


# -------------------------------------------------------------------------------------------------
# Platform
# -------------------------------------------------------------------------------------------------


@hookspec
def vllm_port_platform_describe() -> PlatformDescription:
    """Describe this plugin's platform from constants, without touching the hardware.

    :return: the platform's name, device type, priority, distributed backend, graph-capture
        support, compile backend and memory tiers.

    Calling rule: called once per platform plugin while discovering.
    """


@hookspec
def vllm_port_platform_probe() -> ProbeResult:
    """Look at the machine cheaply: is the platform usable here, with which devices.

    Must not create a device context, compile a kernel or allocate device memory; it may read
    driver queries that do none of these (device counts, NVML, sysfs). When unavailable, the
    reason says what was missing and how to get it.

    :return: availability with its reason, the devices found, and flat capability facts.

    Calling rule: called once per platform plugin while discovering; an exception or a malformed
    result marks the plugin as broken, with the reason, and it is skipped.
    """


@hookspec
def vllm_port_platform_context_created() -> bool:
    """Say whether this process has created a device context for this platform.

    Conformance calls it after the probe to prove the probe stayed cheap.

    :return: ``True`` once a device context exists in this process.

    Calling rule: optional; a plugin without device contexts (CPU) need not implement it.
    """


@hookspec(firstresult=True)
def vllm_port_graph_capture(platform: PlatformDescription) -> GraphCapture | None:
    """Provide graph capture (CUDA graphs, HIP graphs) for ``platform``.

    :param platform: the selected platform; only asked when its description says ``graph_capture``.
    :return: a :class:`vllm_port.graph.GraphCapture`, or ``None`` when this plugin has none for it.

    Calling rule: first non-``None`` result wins.
    """


# -------------------------------------------------------------------------------------------------
# Ops
# -------------------------------------------------------------------------------------------------


@hookspec
def vllm_port_providers() -> list[Provider]:
    """Offer implementations of contract ops.

    :return: providers (see :func:`vllm_port.ops.provider`). Each is checked when registered: its
        op must exist, its signature must equal the op reference's, its dtypes must be defined for
        the op. A provider that fails is refused and recorded; the plugin's others still count.
        A provider runs on the registering plugin's platform unless it names another.

    Calling rule: collect-all; called once per plugin while discovering.
    """


# -------------------------------------------------------------------------------------------------
# Memory
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def vllm_port_allocator(platform: PlatformDescription) -> Allocator | None:
    """Provide the device-memory allocator of ``platform``.

    :param platform: the selected platform.
    :return: an :class:`vllm_port.memory.Allocator`, or ``None`` when this plugin has none for it.

    Calling rule: first non-``None`` result wins, in pluggy's order (``tryfirst`` first, then the
    last registered plugin first), so a plugin may replace the allocator alone.
    """


@hookspec(firstresult=True)
def vllm_port_block_pool(platform: PlatformDescription) -> BlockPoolFactory | None:
    """Provide the paged KV-cache block pool for ``platform``.

    :param platform: the selected platform.
    :return: a factory ``factory(budget_bytes, block_bytes, block_size) -> pool`` that builds the
        pool (the interface of :class:`vllm_port.kv_pool.BlockPool`) from a memory budget and the
        KV layout, or ``None`` to leave core's device-free pool in place.

    Calling rule: first non-``None`` result wins; core's default is registered last.
    """


@hookspec(firstresult=True)
def vllm_port_migrator(platform: PlatformDescription) -> Migrator | None:
    """Provide the migrator that moves KV blocks between ``platform``'s memory tiers.

    :param platform: the selected platform; its ``memory_tiers`` name the tiers to serve.
    :return: a :class:`vllm_port.memory.Migrator`, or ``None`` to leave core's default in place.

    Calling rule: first non-``None`` result wins; core's default is registered last.
    """


# -------------------------------------------------------------------------------------------------
# Communication
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def vllm_port_point_to_point(platform: PlatformDescription) -> PointToPoint | None:
    """Provide point-to-point transfers (send, recv, batched isend/irecv) for ``platform``.

    :param platform: the selected platform.
    :return: a :class:`vllm_port.comm.PointToPoint`, or ``None`` to leave core's default
        (``torch.distributed`` with the platform's backend) in place.

    Calling rule: first non-``None`` result wins; replacing it leaves the collectives untouched.
    """


@hookspec(firstresult=True)
def vllm_port_collectives(platform: PlatformDescription) -> Collectives | None:
    """Provide collectives (all_reduce, all_gather, reduce_scatter, broadcast, barrier) for ``platform``.

    :param platform: the selected platform.
    :return: a :class:`vllm_port.comm.Collectives`, or ``None`` to leave core's default
        (``torch.distributed`` with the platform's backend) in place.

    Calling rule: first non-``None`` result wins; replacing it leaves point-to-point untouched.
    """


#: The hooks every plugin must implement, and those every platform plugin must add.
REQUIRED_HOOKS = ("vllm_port_api_range",)
PLATFORM_HOOKS = ("vllm_port_platform_describe", "vllm_port_platform_probe")
