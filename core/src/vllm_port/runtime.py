"""The runtime: the selected platform with its bound ops, allocator and communicator.

``load()`` runs discovery and selection once; engines keep the returned :class:`Runtime` and call
``bind(dtype)`` to get the kernels for their model.

Where a plugin's part misbehaves, the runtime keeps going and records why in ``Runtime.fallbacks``
(strict mode refuses instead, :mod:`vllm_port.faults`): an allocator whose memory report is
nonsense gives way to core's allocator for the device type; a plugin's comm part that fails is
named in the error (:mod:`vllm_port.guards`). Bound ops in debug mode: :mod:`vllm_port.ops.debug`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from . import device_properties
from .comm import Collectives, Communicator, DistContext, PointToPoint, init_from_env
from .discovery import CORE_PLUGIN, Discovery, PluginRecord, discover, first_result
from .errors import MemoryContractError, PluginError, SelectionError
from .faults import fall_back
from .graph_capture import GraphCapture
from .guards import GuardedCollectives, GuardedPointToPoint, mem_info_problem
from .memory import Allocator, BlockPoolFactory, HostMemoryAllocator, KVCache, KVLayout, Migrator, default_allocator
from .ops import BindContext, BoundOps, OpRegistry
from .ops._custom import as_custom_ops
from .ops.debug import CheckConfig, check_config, checked_ops
from .ops.stats import counted_ops, stats_file
from .platform import PlatformDescription
from .reclaimer import DefaultReclaimer, Reclaimer

__all__ = ["Runtime", "load", "parse_provider_preferences", "select"]

DEVICE_ENV = "VLLM_PORT_DEVICE"
PROVIDERS_ENV = "VLLM_PORT_OP_PROVIDERS"


def select(discovery: Discovery, device: str | None = None, source: str | None = None) -> tuple[PluginRecord, str]:
    """Pick the platform to run on and say why.

    :param device: a platform name; ``VLLM_PORT_DEVICE`` is read when ``None``; otherwise the
        available platform of highest priority wins.
    :param source: who named ``device``, as the errors and the reason say it (default ``--device``,
        or ``VLLM_PORT_DEVICE`` when read from there).
    :raises SelectionError: when the named platform is unknown or unavailable, or none is available.
    """
    source = source or ("--device" if device is not None else DEVICE_ENV)
    device = device if device is not None else (os.environ.get(DEVICE_ENV) or None)
    platforms = discovery.platforms()
    summary = "; ".join(f"{r.name}: {r.reason}" for r in discovery.plugins) or "no plugin is installed"
    if device is not None:
        named = [r for r in platforms if r.description and r.description.name == device]
        if not named:
            known = ", ".join(sorted(r.description.name for r in platforms if r.description)) or "none"
            raise SelectionError(
                f"{source}={device!r} names no installed platform; platforms: {known}. Plugins: {summary}"
            )
        if not named[0].available:
            raise SelectionError(f"{source}={device!r} is not available: {named[0].reason}")
        return named[0], f"named by {source}={device}"
    ranked = sorted((r for r in platforms if r.available), key=lambda r: -r.description.priority)  # type: ignore[union-attr]
    if not ranked:
        raise SelectionError(
            f"no platform is available here. {summary}. Install a vendor plugin, e.g. pip install vllm-port-cpu"
        )
    ranking = ", ".join(f"{r.name} ({r.description.priority})" for r in ranked)  # type: ignore[union-attr]
    return ranked[0], f"highest priority of the available platforms: {ranking}"


def parse_provider_preferences(spec: str | None) -> dict[str, str]:
    """Parse ``"rms_norm=reference,silu_and_mul=cpu_silu_and_mul"`` into ``{op: provider}``."""
    prefer: dict[str, str] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        op, sep, name = item.partition("=")
        if not sep or not op.strip() or not name.strip():
            raise SelectionError(f"{PROVIDERS_ENV}: cannot parse {item!r}; write op=provider pairs separated by commas")
        prefer[op.strip()] = name.strip()
    return prefer


class Runtime:
    """A selected platform and everything bound to it.

    The memory parts are one per runtime: every call of ``allocator(tier)`` answers the same
    allocator (so its accounts cover every buffer of the tier), and every call of ``migrator()`` the
    same migrator (so its guard sees every copy in flight).

    Attributes:
        discovery: every plugin's record and the op registry.
        selected: the chosen platform's record; ``reason`` says why it was chosen.
        fallbacks: each part the runtime replaced on its own, and why (strict mode refuses instead).
    """

    def __init__(self, discovery: Discovery, selected: PluginRecord, reason: str) -> None:
        self.discovery = discovery
        self.selected = selected
        self.reason = reason
        self.fallbacks: list[str] = []
        self._allocators: dict[str, Allocator] = {}
        self._migrator: Migrator | None = None
        self._reclaimer: Reclaimer | None = None
        #: the plugin whose reclaimer answered (``"vllm-port"``: core's default), once ``reclaimer()`` ran
        self.reclaimer_plugin = ""
        if selected.description is not None and selected.probe is not None:
            # the shared kernels size their grids by the selected platform's devices (device_properties)
            device_properties.publish(selected.description.device_type, selected.probe.devices)

    @property
    def platform(self) -> PlatformDescription:
        """The selected platform's description."""
        assert self.selected.description is not None
        return self.selected.description

    @property
    def registry(self) -> OpRegistry:
        return self.discovery.registry

    @property
    def device(self) -> torch.device:
        """The device tensors live on (device 0 of the platform)."""
        return torch.device(self.platform.device_type, 0) if self.platform.device_type != "cpu" else torch.device("cpu")

    def bind_context(self, dtype: torch.dtype) -> BindContext:
        probe = self.selected.probe
        return BindContext(
            self.platform.name, self.platform.device_type, dtype, dict(probe.capabilities) if probe else {}
        )

    def bind(
        self,
        dtype: torch.dtype,
        prefer: Mapping[str, str] | None = None,
        traceable: bool = False,
        *,
        verify: bool = False,
        check: CheckConfig | bool | None = None,
        strict: bool | None = None,
    ) -> BoundOps:
        """Resolve every op once for ``dtype`` on the selected platform.

        :param prefer: op -> provider name overrides; ``VLLM_PORT_OP_PROVIDERS`` is read when ``None``.
        Binding is decided here: the registry resolves each op to a provider; this wraps the
        chosen functions as custom ops (``traceable``) or in debug mode's checks (``check``).

        :param traceable: bind custom-op wrappers for ``torch.compile(fullgraph=True)``
            (:func:`~vllm_port.ops._custom.as_custom_ops`); debug mode leaves such a binding unchecked.
        :param verify: smoke-check every candidate first and skip those that fail (``vllm-port doctor`` does).
        :param check: debug mode's settings; ``VLLM_PORT_CHECK`` is read when ``None``; ``False``: off.
            On, every op is a :class:`~vllm_port.ops.debug.CheckedOp` (:func:`~vllm_port.ops.debug.checked_ops`).
        :param strict: refuse every fallback; ``VLLM_PORT_STRICT`` is read when ``None``.

        With ``VLLM_PORT_STATS=FILE`` every chosen function counts its calls, written to FILE at
        exit (:mod:`vllm_port.ops.stats`).
        """
        if prefer is None:
            prefer = parse_provider_preferences(os.environ.get(PROVIDERS_ENV))
        config = check_config() if check is None else (check or None)
        verify_on = self.device if verify else None
        kernels = self.registry.bind(self.bind_context(dtype), prefer, verify_on=verify_on, strict=strict)
        if stats_file() is not None:  # VLLM_PORT_STATS: count where the kernel runs, inside any wrapper
            kernels = counted_ops(kernels)
        if traceable:  # a compiled graph calls the custom ops, never debug mode's wrappers
            return as_custom_ops(kernels, self.registry.ops)
        return kernels if config is None else checked_ops(kernels, self.registry.ops, config)

    def allocator(self, tier: str = "device") -> Allocator:
        """The allocator of one of the selected platform's memory tiers; the same object on every call.

        ``device`` comes from the platform's plugin, or from core when no plugin answers
        (:func:`~vllm_port.memory.default_allocator`: host memory on ``cpu``, torch's caching
        allocator on the current accelerator); core serves ``pinned_host`` and ``host``
        (:class:`~vllm_port.memory.HostMemoryAllocator`) for platforms that declare them.

        :raises MemoryContractError: for a tier the platform does not declare, or one core cannot serve.
        :raises PluginError: when no plugin answers for the device tier and core has no default for it.
        """
        if tier not in self._allocators:
            self._allocators[tier] = self._build_allocator(tier)
        return self._allocators[tier]

    def _build_allocator(self, tier: str) -> Allocator:
        if tier not in self.platform.memory_tiers:
            raise MemoryContractError(
                f"platform {self.platform.name!r} has no memory tier {tier!r}; "
                f"its tiers are {', '.join(self.platform.memory_tiers)}"
            )
        if tier in ("pinned_host", "host"):
            return HostMemoryAllocator(pinned=tier == "pinned_host")
        if tier != "device":
            raise MemoryContractError(
                f"platform {self.platform.name!r} declares memory tier {tier!r}, but core serves only "
                "device, pinned_host and host allocators"
            )
        plugin, allocator = first_result(self.discovery.manager, "vllm_port_allocator", platform=self.platform)
        if allocator is None:
            allocator = default_allocator(self.platform.device_type)
            if allocator is None:
                raise PluginError(
                    f"platform {self.platform.name!r} has no allocator: no plugin answered vllm_port_allocator, and "
                    f"core's default serves only cpu and torch's current accelerator, not {self.platform.device_type!r}; "
                    "implement vllm_port_allocator in the platform's plugin"
                )
        if not isinstance(allocator, Allocator):
            raise PluginError(
                f"platform {self.platform.name!r}: plugin {plugin!r} answered vllm_port_allocator with {allocator!r}, "
                "not a vllm_port.memory.Allocator"
            )
        if plugin:  # a plugin's allocator: its memory report sizes the KV cache, so it is checked first
            allocator = self._checked_allocator(plugin, allocator)
        return allocator

    def _checked_allocator(self, plugin: str, allocator: Allocator) -> Allocator:
        """``allocator``, or core's allocator for the device type when the plugin's reports nonsense."""
        core = default_allocator(self.platform.device_type)
        problem = mem_info_problem(allocator, core)
        if problem is None:
            return allocator
        what = f"platform {self.platform.name!r}: the allocator {allocator.name!r} of plugin {plugin!r}: {problem}"
        fix = f"Fix _mem_info in plugin {plugin!r}"
        if core is None:
            raise PluginError(
                f"{what}; core has no allocator of its own for device type {self.platform.device_type!r} to use "
                f"instead. {fix}"
            )
        fall_back(f"{what}; core's {core.name!r} allocator serves instead", fix, record=self.fallbacks)
        return core

    def block_pool_factory(self) -> BlockPoolFactory:
        """The selected platform's KV-cache block pool factory (core's device-free pool by default)."""
        plugin, factory = first_result(self.discovery.manager, "vllm_port_block_pool", platform=self.platform)
        if not callable(factory):
            raise PluginError(
                f"platform {self.platform.name!r} has no block pool: vllm_port_block_pool answered {factory!r}"
                f"{' from ' + plugin if plugin else ''}, not a factory"
            )
        return factory

    def migrator(self) -> Migrator:
        """The selected platform's migrator between memory tiers (core's ``TorchMigrator`` by default);
        the same object on every call, so one copy in flight guards its blocks against every caller."""
        if self._migrator is None:
            self._migrator = self._build_migrator()
        return self._migrator

    def _build_migrator(self) -> Migrator:
        plugin, migrator = first_result(self.discovery.manager, "vllm_port_migrator", platform=self.platform)
        if not callable(getattr(migrator, "copy_blocks", None)):
            raise PluginError(
                f"platform {self.platform.name!r} has no migrator: vllm_port_migrator answered {migrator!r}"
                f"{' from ' + plugin if plugin else ''}, which has no copy_blocks"
            )
        return migrator

    def reclaimer(self) -> Reclaimer:
        """The selected platform's reclaimer: a plugin's answer to ``vllm_port_reclaimer``, else core's
        :class:`~vllm_port.reclaimer.DefaultReclaimer`; the same object on every call.

        :raises PluginError: when a plugin answers with something that has no ``plan`` method.
        """
        if self._reclaimer is None:
            plugin, reclaimer = first_result(self.discovery.manager, "vllm_port_reclaimer", platform=self.platform)
            if reclaimer is None:
                reclaimer, plugin = DefaultReclaimer(), "vllm-port"
            if not callable(getattr(reclaimer, "plan", None)):
                raise PluginError(
                    f"platform {self.platform.name!r}: plugin {plugin!r} answered vllm_port_reclaimer with "
                    f"{reclaimer!r}, which has no plan(pressure) method (see vllm_port.reclaimer.Reclaimer)"
                )
            self._reclaimer, self.reclaimer_plugin = reclaimer, plugin
        return self._reclaimer

    def kv_cache(self, layout: KVLayout, budget: float | int, tier: str = "device") -> KVCache:
        """The paged KV cache of ``layout`` in ``budget`` (a fraction of free memory, or bytes) in ``tier``.

        The device tier is laid out for the attention kernels (head-major where the platform says
        ``kv_head_major``); other tiers (swap space) are block-major, so the migrator moves each block in one piece.
        """
        device = tier == "device"
        return KVCache(
            self.allocator(tier),
            layout,
            budget,
            self.block_pool_factory(),
            block_major=not device,
            head_major=device and self.platform.kv_head_major,
        )

    def graph_capture(self) -> GraphCapture | None:
        """The platform's graph capture, or ``None`` when it has none (a runner then runs eagerly)."""
        if not self.platform.graph_capture:
            return None
        plugin, capture = first_result(self.discovery.manager, "vllm_port_graph_capture", platform=self.platform)
        if not isinstance(capture, GraphCapture):
            raise PluginError(
                f"platform {self.platform.name!r} says graph_capture=True but no plugin answered "
                f"vllm_port_graph_capture with a GraphCapture (got {capture!r}{' from ' + plugin if plugin else ''})"
            )
        return capture

    def communicator(self) -> Communicator:
        """The selected platform's point-to-point and collectives, each from whichever plugin serves it."""
        p2p_plugin, p2p = first_result(self.discovery.manager, "vllm_port_point_to_point", platform=self.platform)
        coll_plugin, coll = first_result(self.discovery.manager, "vllm_port_collectives", platform=self.platform)
        if not isinstance(p2p, PointToPoint) or not isinstance(coll, Collectives):
            raise PluginError(
                f"comm parts for {self.platform.name!r} are not PointToPoint/Collectives: {p2p!r}, {coll!r}"
            )
        # a plugin's part is wrapped so its failures name it; core's own already name the rank and the call
        if p2p_plugin != CORE_PLUGIN:
            p2p = GuardedPointToPoint(p2p, p2p_plugin)
        if coll_plugin != CORE_PLUGIN:
            coll = GuardedCollectives(coll, coll_plugin)
        return Communicator(p2p, coll)

    def init_process_group(self, timeout_s: float = 300.0) -> DistContext:
        """Join the process group ``torchrun`` set up, with this platform's backend (:func:`vllm_port.comm.init_from_env`).

        The selected platform's probe gives the number of devices on this node, so launching more
        ranks per node than devices is refused by name.
        """
        probe = self.selected.probe
        return init_from_env(self.platform, timeout_s, probe.device_count if probe is not None else None)


def load(plugins: str | None = None, device: str | None = None, probe_timeout_s: float | None = None) -> Runtime:
    """Discover installed plugins and select a platform.

    :param plugins: allow/deny list, as ``VLLM_PORT_PLUGINS`` (``"cpu,cuda"`` or ``"-xpu"``).
    :param device: platform to use, as ``VLLM_PORT_DEVICE``; the best available one when unset.
    :param probe_timeout_s: seconds each plugin's probe may take, as ``VLLM_PORT_PROBE_TIMEOUT``
        (5 s by default); a probe that takes longer leaves its platform unavailable.
    :raises SelectionError: for an unknown plugin or platform name, or when none is available.
    """
    discovery = discover(plugins, probe_timeout_s=probe_timeout_s)
    selected, reason = select(discovery, device)
    return Runtime(discovery, selected, reason)
