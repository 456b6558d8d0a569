"""Discover installed plugins, check them against the contracts, and select a platform.

Data flows one way: discover -> select -> bind -> run. Every plugin is loaded, validated and
probed on its own; one that fails at any step is recorded with the reason and skipped, and never
takes the process down. Each probe runs under a time limit (``VLLM_PORT_PROBE_TIMEOUT``, 5 s by
default) on a daemon thread: a probe that hangs marks its platform unavailable, naming the plugin and
the limit, and neither stalls discovery nor keeps the process alive at exit.

Strict mode (:mod:`vllm_port.faults`) refuses what discovery would otherwise skip and record: a plugin
that failed, a provider refused at registration, an unknown ``VLLM_PORT_*`` setting, and the code of
a plugin that the allow/deny list keeps out but that was imported anyway.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from . import _defaults, hookspecs
from .api import API_VERSION, ENTRY_POINT_GROUP, ApiRange
from .errors import ApiVersionError, PluginError, ProviderRejectedError, SelectionError, StrictModeError
from .faults import (
    SETTINGS,
    STRICT_ENV,
    Setting,
    check_switches,
    describe_unknown,
    strict_mode,
    unknown_settings,
    warn_unknown_settings,
)
from .ops import ALL_OPS, OpRegistry, Provider
from .ops.debug import check_config
from .platform import PlatformDescription, ProbeResult, validate_description, validate_probe

__all__ = [
    "DEFAULT_PROBE_TIMEOUT_S",
    "ENTRY_POINT_GROUP",
    "PROBE_TIMEOUT_ENV",
    "Discovery",
    "PluginRecord",
    "discover",
    "parse_plugin_filter",
    "probe_again",
    "probe_timeout",
]

CORE_PLUGIN = "vllm-port"
PLUGINS_ENV = "VLLM_PORT_PLUGINS"
PROBE_TIMEOUT_ENV = "VLLM_PORT_PROBE_TIMEOUT"
#: Seconds a probe may take. Generous for a cheap query (NVML on eight GPUs answers in well under a
#: second), short enough that a hung driver never stalls ``load()`` or ``doctor`` for long.
DEFAULT_PROBE_TIMEOUT_S = 5.0


@dataclass
class PluginRecord:
    """What discovery learned about one installed plugin.

    Attributes:
        name: the entry-point name (``"cpu"``); also how ``VLLM_PORT_PLUGINS`` names it.
        distribution: the installed distribution that declares it, and its ``version``.
        api_range: the contract versions it says it implements.
        description, probe: its platform's answers, when it is a platform plugin.
        providers: the providers it registered; ``rejected`` the messages for those refused.
        error: why the whole plugin was skipped, or ``None``.
        probe_s: seconds its probe took (up to the limit, when it timed out); ``None`` if never probed.
        settings: the ``VLLM_PORT_<PLUGIN>_*`` variables it declares (``vllm_port_settings``).
    """

    name: str
    distribution: str = ""
    version: str = ""
    api_range: str = ""
    description: PlatformDescription | None = None
    probe: ProbeResult | None = None
    providers: list[Provider] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    error: str | None = None
    probe_s: float | None = None
    settings: dict[str, Setting] = field(default_factory=dict)

    @property
    def available(self) -> bool:
        """Whether its platform loaded cleanly and can run here."""
        return self.error is None and self.probe is not None and self.probe.available

    @property
    def reason(self) -> str:
        """Why it is or is not available, in one sentence."""
        if self.error is not None:
            return self.error
        if self.probe is None:
            return "not a platform plugin (it only adds providers or parts to other platforms)"
        return self.probe.reason


@dataclass
class Discovery:
    """The outcome of discovery: the plugin manager, what each plugin said, the op registry, and the
    time limit each probe ran under."""

    manager: pluggy.PluginManager
    plugins: list[PluginRecord]
    excluded: list[str]
    registry: OpRegistry
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S
    #: what strict mode refuses here, one sentence each: failed plugins, refused providers, unknown
    #: settings, excluded plugins whose code was imported anyway (empty when nothing is amiss)
    problems: list[str] = field(default_factory=list)

    def platforms(self) -> list[PluginRecord]:
        """Records of platform plugins that loaded cleanly."""
        return [r for r in self.plugins if r.description is not None and r.error is None]


def parse_plugin_filter(spec: str | None) -> tuple[set[str], set[str]]:
    """Parse ``"cpu,cuda"`` (allow only) or ``"-rocm,-xpu"`` (deny) into ``(allow, deny)`` name sets."""
    allow: set[str] = set()
    deny: set[str] = set()
    for item in (spec or "").split(","):
        item = item.strip()
        if item.startswith("-"):
            deny.add(item[1:].strip())
        elif item:
            allow.add(item)
    return allow, deny


def probe_timeout(seconds: float | None = None) -> float:
    """The probe time limit: ``seconds`` if given, else ``VLLM_PORT_PROBE_TIMEOUT``, else the default.

    :raises SelectionError: when the limit is not a positive finite number of seconds.
    """
    source, value, given = "probe_timeout_s", seconds, repr(seconds)
    if value is None:
        raw = os.environ.get(PROBE_TIMEOUT_ENV, "").strip()
        if not raw:
            return DEFAULT_PROBE_TIMEOUT_S
        source, given = PROBE_TIMEOUT_ENV, repr(raw)
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise SelectionError(
            f"{source}={given} is not a time limit; give a positive number of seconds "
            f"(default {DEFAULT_PROBE_TIMEOUT_S:g})"
        )
    return float(value)


def discover(
    plugins: str | None = None,
    entry_points: Sequence[metadata.EntryPoint] | None = None,
    probe_timeout_s: float | None = None,
    strict: bool | None = None,
) -> Discovery:
    """Load, validate and probe every installed plugin that the filter admits.

    :param plugins: allow/deny list as in ``VLLM_PORT_PLUGINS`` (read when ``None``).
    :param entry_points: the entry points to load instead of the installed ones (tests).
    :param probe_timeout_s: seconds each probe may take (``VLLM_PORT_PROBE_TIMEOUT`` when ``None``);
        a probe still running then marks its plugin unavailable and is left behind on a daemon thread.
    :param strict: refuse every problem in ``Discovery.problems`` (``VLLM_PORT_STRICT`` when ``None``).
    :raises SelectionError: when the filter names a plugin that is not installed, or the limit is not
        a positive number.
    :raises StrictModeError: in strict mode, when anything was skipped or refused (all of it, one per line).
    """
    limit = probe_timeout(probe_timeout_s)
    check_switches()
    check_config()  # debug mode's VLLM_PORT_CHECK and VLLM_PORT_CHECK_SEED, read for real when the runtime binds
    found = list(entry_points if entry_points is not None else metadata.entry_points(group=ENTRY_POINT_GROUP))
    spec = plugins if plugins is not None else os.environ.get(PLUGINS_ENV)
    allow, deny = parse_plugin_filter(spec)
    names = {ep.name for ep in found}
    unknown = sorted((allow | deny) - names)
    if unknown:
        source = "--plugins" if plugins is not None else PLUGINS_ENV
        raise SelectionError(
            f"{source}={spec!r} names {', '.join(map(repr, unknown))}, but no installed plugin is called that; "
            f"installed plugins: {', '.join(sorted(names)) or 'none'}. Fix the name, or pip install vllm-port-<name>"
        )
    imported_before = set(sys.modules)
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.register(_defaults, name=CORE_PLUGIN)
    registry = OpRegistry(ALL_OPS)
    records: list[PluginRecord] = []
    excluded: list[str] = []
    for ep in sorted(found, key=lambda e: e.name):
        if (allow and ep.name not in allow) or ep.name in deny:
            excluded.append(ep.name)
            continue
        record = _load_one(manager, registry, ep, records, limit)
        records.append(record)
    found_now = Discovery(manager, records, excluded, registry, limit)
    source = f"--plugins={spec!r}" if plugins is not None else f"{PLUGINS_ENV}={spec!r}"
    found_now.problems = _problems(found_now, found, source, set(sys.modules) - imported_before)
    if found_now.problems and strict_mode(strict):
        raise StrictModeError(
            f"strict mode ({STRICT_ENV}=1) refuses what discovery would skip:\n  "
            + "\n  ".join(found_now.problems)
            + f"\nFix or uninstall each plugin named, deny it (VLLM_PORT_PLUGINS=-NAME), or unset {STRICT_ENV}"
        )
    _warn_unknown(found_now, found)
    return found_now


def _problems(
    found: Discovery, entry_points: Sequence[metadata.EntryPoint], source: str, imported: set[str]
) -> list[str]:
    """What strict mode refuses in ``found``: one sentence each, naming the plugin and the reason.

    ``imported`` are the modules first imported while discovering: an excluded plugin's module among
    them was imported by a plugin that was let in.
    """
    problems = [
        f"plugin {r.name!r} ({r.distribution} {r.version}) was skipped: {r.error}" for r in found.plugins if r.error
    ]
    problems += [f"plugin {r.name!r}: provider refused: {msg}" for r in found.plugins for msg in r.rejected]
    for ep in entry_points:
        module = ep.value.partition(":")[0].strip()
        if ep.name in found.excluded and module in imported:
            problems.append(
                f"plugin {ep.name!r} is kept out by {source}, but its module {module!r} was imported while the admitted "
                "plugins loaded, so its code ran; uninstall it, or remove the import from the plugin that makes it"
            )
    declared = {r.name: r.settings for r in found.plugins if r.error is None}
    unknown = unknown_settings((ep.name for ep in entry_points), declared=declared)
    if unknown:
        known = {*SETTINGS}.union(*declared.values())
        problems.append(describe_unknown(unknown, known))
    return problems


def _warn_unknown(found: Discovery, entry_points: Sequence[metadata.EntryPoint]) -> None:
    """Outside strict mode: one warning line per unknown ``VLLM_PORT_*`` setting, naming the closest known one."""
    declared = {r.name: r.settings for r in found.plugins if r.error is None}
    unknown = unknown_settings((ep.name for ep in entry_points), declared=declared)
    if unknown:
        warn_unknown_settings(unknown, {*SETTINGS}.union(*declared.values()))


class _InvalidSettingError(SelectionError):
    """A set value outside a plugin's declared choices: the user's mistake, so discovery stops (not the plugin's)."""


def _check_setting_values(record: PluginRecord) -> None:
    """Refuse a set value outside the choices a plugin declares for it, in every mode.

    :raises SelectionError: naming the setting, its plugin, what it does and the values it accepts.
    """
    for name, setting in record.settings.items():
        raw = os.environ.get(name)
        if raw is None or not setting.choices or raw.strip().lower() in setting.choices:
            continue
        accepted = ", ".join(repr(c) for c in setting.choices)
        raise _InvalidSettingError(
            f"{name}={raw!r} is not a value plugin {record.name!r} takes for it ({setting.meaning}); "
            f"accepted: {accepted}; fix it or unset it"
        )


def _declared_settings(plugin: str, declared: Any) -> dict[str, Setting]:
    """A plugin's ``vllm_port_settings`` answer, checked: its own ``VLLM_PORT_<PLUGIN>_*`` names, each a ``Setting``."""
    if not isinstance(declared, Mapping):
        raise PluginError(f"vllm_port_settings must return a mapping of name -> Setting, got {type(declared).__name__}")
    prefix = f"VLLM_PORT_{plugin.upper().replace('-', '_')}_"
    for name, setting in declared.items():
        if not isinstance(name, str) or not name.startswith(prefix) or name in SETTINGS:
            raise PluginError(
                f"vllm_port_settings declares {name!r}; a plugin's settings are named {prefix}* (its own prefix)"
            )
        if not isinstance(setting, Setting):
            raise PluginError(f"vllm_port_settings: {name} must map to a vllm_port.faults.Setting, got {setting!r:.80}")
    return dict(declared)


def _load_one(
    manager: pluggy.PluginManager,
    registry: OpRegistry,
    ep: metadata.EntryPoint,
    seen: list[PluginRecord],
    probe_timeout_s: float,
) -> PluginRecord:
    dist = getattr(ep, "dist", None)
    record = PluginRecord(ep.name, dist.name if dist else "?", dist.version if dist else "?")
    try:
        if any(r.name == ep.name for r in seen):
            raise PluginError(
                f"another installed distribution already declares a plugin named {ep.name!r}; uninstall one of them"
            )
        try:
            module = ep.load()
        except (Exception, SystemExit) as exc:
            raise PluginError(
                f"import of {ep.value!r} failed: {type(exc).__name__}: {exc}. Fix or reinstall {record.distribution}"
            ) from exc
        _register(manager, ep.name, module)
        try:
            _check_plugin(manager, registry, module, record, seen, probe_timeout_s)
        except Exception:
            manager.unregister(module)
            raise
    except _InvalidSettingError:
        raise
    except PluginError as exc:
        record.error = str(exc)
    except Exception as exc:  # a plugin bug must never take discovery down
        record.error = f"{type(exc).__name__}: {exc}"
    return record


def _register(manager: pluggy.PluginManager, name: str, module: Any) -> None:
    try:
        manager.register(module, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(
            f"does not match the hook specs: {exc}. Make each hookimpl's arguments a subset of the spec's (vllm_port.hookspecs)"
        ) from exc
    unknown = [caller.name for caller in manager.get_hookcallers(module) or [] if caller.spec is None]
    if unknown:
        manager.unregister(module)
        raise PluginError(
            f"implements {', '.join(unknown)}, which the contract does not define; check the spelling against vllm_port.hookspecs"
        )


def _check_plugin(
    manager: pluggy.PluginManager,
    registry: OpRegistry,
    module: Any,
    record: PluginRecord,
    seen: list[PluginRecord],
    probe_timeout_s: float,
) -> None:
    call = _own_caller(manager, module, record.name)
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not call.has(h)]
    if missing:
        raise PluginError(
            f"does not implement the required hook {', '.join(missing)}; return the API range it supports, e.g. '>=1.0,<2'"
        )
    record.api_range = str(call("vllm_port_api_range"))
    try:
        supported = API_VERSION in ApiRange(record.api_range)
    except ValueError as exc:
        raise PluginError(f"vllm_port_api_range returned an invalid range: {exc}") from exc
    if not supported:
        raise ApiVersionError(
            f"supports contract API {record.api_range}, but core is {API_VERSION}; "
            f"install a {record.distribution} release built for API {API_VERSION}, or a vllm-port release in its range"
        )
    if call.has("vllm_port_settings"):  # before the probe, which may read them
        record.settings = _declared_settings(record.name, call("vllm_port_settings"))
        _check_setting_values(record)
    platform_hooks = [call.has(h) for h in hookspecs.PLATFORM_HOOKS]
    if any(platform_hooks) and not all(platform_hooks):
        raise PluginError(f"a platform plugin must implement both {' and '.join(hookspecs.PLATFORM_HOOKS)}")
    if all(platform_hooks):
        record.description = validate_description(call("vllm_port_platform_describe"))
        taken = [
            r.name
            for r in seen
            if r.description is not None and r.error is None and r.description.name == record.description.name
        ]
        if taken:
            raise PluginError(
                f"describes platform {record.description.name!r}, which plugin {taken[0]!r} already provides"
            )
        record.probe = validate_probe(_probe_within(call, record, probe_timeout_s))
    offered = call("vllm_port_providers") if call.has("vllm_port_providers") else []
    platform = record.description.name if record.description else ""
    for candidate in offered or []:
        try:
            record.providers.append(registry.register(candidate, plugin=record.name, platform=platform))
        except ProviderRejectedError as exc:
            record.rejected.append(str(exc))


def probe_again(found: Discovery, record: PluginRecord) -> None:
    """Probe ``record``'s platform once more, under the same time limit, and keep the answer when it is valid.

    ``doctor`` asks once the platform's kernels are bound: a probe builds nothing, so what binding
    built and loaded (the CPU plugin's native library, say) shows only in a later answer. An answer
    that fails, or says the platform is no longer available, leaves the first one.
    """
    module = found.manager.get_plugin(record.name)
    if module is None or record.probe is None:
        return
    first_s = record.probe_s
    try:
        answer = validate_probe(
            _probe_within(_own_caller(found.manager, module, record.name), record, found.probe_timeout_s)
        )
    except Exception:  # the first answer stands; doctor reports, it never crashes
        answer = None
    record.probe_s = first_s
    if answer is not None and answer.available:
        record.probe = answer


def _probe_within(call: _own_caller, record: PluginRecord, limit_s: float) -> Any:
    """Call the plugin's probe on a daemon thread and wait at most ``limit_s`` for its answer.

    A daemon thread, because a probe stuck in a driver call cannot be interrupted: it is left
    behind, and must not keep the process alive at exit.
    """
    outcome: list[Any] = []  # [result] or [None, exception]

    def run() -> None:
        try:
            outcome.append(call("vllm_port_platform_probe"))
        except BaseException as exc:  # handed to the caller's thread, which decides
            outcome.extend((None, exc))

    thread = threading.Thread(target=run, name=f"vllm-port probe {record.name}", daemon=True)
    start = time.perf_counter()
    thread.start()
    thread.join(limit_s)
    record.probe_s = round(time.perf_counter() - start, 6)
    if thread.is_alive():
        raise PluginError(
            f"plugin {record.name!r}: vllm_port_platform_probe did not answer within the {limit_s:g} s limit "
            f"({PROBE_TIMEOUT_ENV}), so its platform counts as unavailable; a probe must be a cheap query "
            "(no device context, no kernel build, no hanging driver call). Fix the probe, or raise the limit"
        )
    if len(outcome) == 2:
        exc = outcome[1]
        if isinstance(exc, Exception):
            raise exc
        raise PluginError(f"vllm_port_platform_probe raised {type(exc).__name__}: {exc}") from exc  # e.g. sys.exit()
    return outcome[0]


class _own_caller:  # noqa: N801 - reads as a function at the call site
    """Calls one plugin's own implementation of a hook, turning its failures into ``PluginError``."""

    def __init__(self, manager: pluggy.PluginManager, module: Any, name: str) -> None:
        self._impls: dict[str, Callable[..., Any]] = {}
        for caller in manager.get_hookcallers(module) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is module:
                    self._impls[caller.name] = impl.function
        self._name = name

    def has(self, hook: str) -> bool:
        return hook in self._impls

    def __call__(self, hook: str, **kwargs: Any) -> Any:
        try:
            return self._impls[hook](**kwargs)
        except Exception as exc:
            raise PluginError(f"{hook} raised {type(exc).__name__}: {exc}") from exc


def first_result(manager: pluggy.PluginManager, hook: str, **kwargs: Any) -> tuple[str, Any]:
    """Call ``hook`` in pluggy's order and return ``(plugin name, first non-None result)``.

    Unlike ``manager.hook.<name>(...)``, a failure names the plugin that raised.
    """
    for impl in reversed(getattr(manager.hook, hook).get_hookimpls()):
        try:
            result = impl.function(**kwargs)
        except Exception as exc:
            raise PluginError(f"plugin {impl.plugin_name!r}: {hook} raised {type(exc).__name__}: {exc}") from exc
        if result is not None:
            return impl.plugin_name, result
    return "", None
