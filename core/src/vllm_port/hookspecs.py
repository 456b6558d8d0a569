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
    from collections.abc import Callable, Mapping
    from typing import Any

    from .comm import Collectives, PointToPoint
    from .faults import Setting
    from .graph_capture import GraphCapture
    from .graph_pass import GraphPass
    from .memory import Allocator, BlockPoolFactory, Migrator
    from .ops import Provider
    from .platform import PlatformDescription, ProbeResult
    from .reclaimer import Reclaimer

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
    :return: a :class:`vllm_port.graph_capture.GraphCapture`, or ``None`` when this plugin has none for it.

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
        When no plugin answers, core serves its default (:func:`vllm_port.memory.default_allocator`:
        host memory for ``cpu``, torch's caching allocator for torch's current accelerator); a
        platform on any other device type must answer.

    Calling rule: first non-``None`` result wins, in pluggy's order (``tryfirst`` first, then the
    last registered plugin first), so a plugin may replace the allocator alone. The runtime asks
    once and keeps the answer: one allocator per tier per runtime.
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


# -------------------------------------------------------------------------------------------------
# Compilation (contract API 1.1)
# -------------------------------------------------------------------------------------------------


@hookspec
def vllm_port_graph_passes(platform: PlatformDescription) -> list[GraphPass] | None:
    """Contribute rewrites of flat graphs (fusions of this plugin's own, or substitutions its kernels pay for).

    A pass is a :class:`vllm_port.graph_pass.GraphPass`: a name and ``fn(module, context) -> int``
    that rewrites the aten-level ``torch.fx`` graph in place and returns how many times it fired.
    ``context.ops`` maps each contract op to the custom op a new node should call, so a pass builds
    contract nodes bound to the platform's providers; a pass may also insert the plugin's own
    ``torch.library`` ops. Passes run on every flat graph (eager and compiled alike) after core's
    fusions, so they must keep the graph's results within the ops' tolerances.

    :param platform: the selected platform; return ``None`` or ``[]`` for platforms the passes do not serve.
    :return: the passes, in the order they run.

    Calling rule: collect-all, in plugin load order; optional (API 1.1). A pass that raises or
    returns something other than a count stops the compilation with an error naming the plugin.
    """


@hookspec(firstresult=True)
def vllm_port_compile_backend(platform: PlatformDescription) -> str | Callable[..., Any] | None:
    """Name the compiler that compiles the pieces of ``platform``'s flat graphs under the ``vllm_port`` backend.

    The ``vllm_port`` torch.compile backend runs the fusion passes, splits the graph at attention
    and hands each piece between to this compiler. Without an answer it uses
    ``PlatformDescription.compile_backend`` (``"none"`` there: the platform has no code generator
    and models run eagerly with its kernels).

    :param platform: the selected platform.
    :return: a registered torch.compile backend name (``"inductor"``, a vendor's), a callable
        ``(graph_module, example_inputs) -> callable`` as torch.compile backends are, ``"none"``
        to leave the pieces uncompiled, or ``None`` to leave the choice to the platform description.

    Calling rule: first non-``None`` result wins; optional (API 1.1).
    """


# -------------------------------------------------------------------------------------------------
# Memory: the reclaimer (contract API 1.1)
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def vllm_port_reclaimer(platform: PlatformDescription) -> Reclaimer | None:
    """Provide the policy that decides what gives way when ``platform``'s KV-cache pool runs short.

    The engine's scheduler asks the reclaimer, with device-free facts
    (:class:`vllm_port.reclaimer.MemoryPressure`), which cached blocks to evict and which running
    requests to preempt, each by swap or by recompute; it checks the answer
    (:func:`vllm_port.reclaimer.check_plan`: only cached-free blocks, only candidate requests, swaps
    that fit, enough freed when it can be) and carries it out. The reclaimer never touches the pool.

    :param platform: the selected platform.
    :return: a :class:`vllm_port.reclaimer.Reclaimer` (an object with ``plan(pressure) -> ReclaimPlan``),
        or ``None`` to leave core's :class:`~vllm_port.reclaimer.DefaultReclaimer` in place.

    Calling rule: first non-``None`` result wins, so a plugin may replace the reclaimer alone;
    optional (API 1.1). A plan that breaks the rules stops the engine with an error naming the plugin.
    """


# -------------------------------------------------------------------------------------------------
# Settings
# -------------------------------------------------------------------------------------------------


@hookspec
def vllm_port_settings() -> Mapping[str, Setting]:
    """Declare the environment variables this plugin reads, so core can check them.

    :return: setting name -> :class:`vllm_port.faults.Setting` (what it does, and the values it
        accepts; :data:`vllm_port.faults.SWITCH_VALUES` for an on/off switch). Every name must start
        with ``VLLM_PORT_<PLUGIN>_`` (the plugin's entry-point name in upper case, ``-`` as ``_``).
        Discovery refuses a set value outside a setting's ``choices`` in every mode, naming the
        setting, the plugin and the accepted values; strict mode refuses any
        ``VLLM_PORT_<PLUGIN>_*`` variable the plugin does not declare (a misspelling).

    Calling rule: collect-all; called once per plugin while discovering; optional (a plugin that
    does not implement it declares no setting).
    """


#: The hooks every plugin must implement, and those every platform plugin must add.
REQUIRED_HOOKS = ("vllm_port_api_range",)
PLATFORM_HOOKS = ("vllm_port_platform_describe", "vllm_port_platform_probe")
