"""Strict mode, and the settings vllm-port knows: where the layer would fall back on its own, say so or refuse.

By default vllm-port keeps running past a broken part and records why: a plugin that fails to load
is skipped, a provider refused at registration or failing its check gives way to the next
candidate, the reference serves an op the platform's kernels do not cover, core's allocator
replaces one that reports nonsense (``vllm-port doctor`` lists each). Strict mode
(``VLLM_PORT_STRICT=1``, or ``--strict`` on any command) turns every such fallback into a
:class:`~vllm_port.errors.StrictModeError` naming what was skipped and why, and also refuses an
unknown ``VLLM_PORT_*`` setting and the code of a plugin the allow/deny list keeps out.

This module is on the ground floor: ops, discovery and the runtime all report their fallbacks here.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from .errors import SelectionError, StrictModeError

__all__ = [
    "SETTINGS",
    "STRICT_ENV",
    "SWITCHES",
    "SWITCH_VALUES",
    "Setting",
    "check_switches",
    "closest_setting",
    "fall_back",
    "read_switch",
    "register_setting",
    "strict_mode",
    "unknown_settings",
    "warn_unknown_settings",
]

STRICT_ENV = "VLLM_PORT_STRICT"
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"0", "false", "no", "off"})
#: What an on/off setting accepts (any case, surrounding spaces ignored); empty means its default.
SWITCH_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off", "")

log = logging.getLogger("vllm_port.faults")

#: Every ``VLLM_PORT_*`` environment variable that vllm-port, its tools or its tests read, and what it
#: does. Strict mode refuses any other (a misspelt setting is otherwise silently ignored); a plugin's own
#: settings are those named ``VLLM_PORT_<PLUGIN>_*`` after an installed plugin (``VLLM_PORT_CPU_NATIVE``).
SETTINGS: dict[str, str] = {
    "VLLM_PORT_PLUGINS": "plugins to load (cpu,cuda) or to deny (-rocm)",
    "VLLM_PORT_DEVICE": "the platform to use instead of the best available one",
    "VLLM_PORT_OP_PROVIDERS": "op=provider pairs that force a provider for an op",
    "VLLM_PORT_PROBE_TIMEOUT": "seconds a plugin's probe may take",
    "VLLM_PORT_STRICT": "1: every fallback is an error",
    "VLLM_PORT_CHECK": "debug mode: the share of bound-op calls compared with the reference (0.01, or 1 for all)",
    "VLLM_PORT_CHECK_DIR": "where debug mode writes reproducers (default ./vllm-port-check)",
    "VLLM_PORT_CHECK_SEED": "the seed that picks which calls debug mode compares",
    "VLLM_PORT_VALIDATE": "1: op input checks read tensor values too (token ids, slots, block tables in range)",
    "VLLM_PORT_CHECK_WEIGHTS": "0: load weights without refusing tensors that hold NaN or Inf (default 1)",
    "VLLM_PORT_CERTIFY_PROGRESS": "set by certify for its suite run: the file its recorder appends a line to per finished check",
    "VLLM_PORT_GIT_COMMIT": "the commit a certification report names, where the tree has no .git",
    "VLLM_PORT_PLUGIN_GIT_COMMIT": "the commit of a plugin certified from outside this repository",
    "VLLM_PORT_CORE": "tox: the vllm-port checkout a generated plugin installs",
    "VLLM_PORT_CONFORMANCE": "tox: the conformance checkout a generated plugin installs",
    "VLLM_PORT_TORCH": "dev scripts: the torch build to install",
    "VLLM_PORT_CACHE_DIR": "where plugins cache built kernels",
    "VLLM_PORT_STATS": "a JSON file where each process writes, at exit, its calls per bound op and provider",
    "VLLM_PORT_CERTIFICATE": "the vLLM bridge: the certification report (report.json) of the plugin it runs",
    "VLLM_PORT_TRITON_CACHED_LAUNCH": "0: every Triton kernel launch goes through Triton's own argument binding",
}


#: The settings of :data:`SETTINGS` that are on/off switches (:func:`read_switch`): discovery refuses
#: any other value of them in every mode (:func:`check_switches`). A new switch is added here too.
SWITCHES: list[str] = [
    "VLLM_PORT_STRICT",
    "VLLM_PORT_VALIDATE",
    "VLLM_PORT_CHECK_WEIGHTS",
    "VLLM_PORT_TRITON_CACHED_LAUNCH",
]


@dataclass(frozen=True)
class Setting:
    """One ``VLLM_PORT_<PLUGIN>_*`` environment variable a plugin reads (``vllm_port_settings``).

    Attributes:
        meaning: what it does, in a phrase (shown where an unknown or invalid setting is reported).
        choices: the values it accepts (compared ignoring case and surrounding spaces; ``""`` for
            "set but empty"), or empty when it takes free text (a path, a list); core refuses any
            other value in every mode. :data:`SWITCH_VALUES` for an on/off switch.
    """

    meaning: str
    choices: tuple[str, ...] = ()


def read_switch(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """An on/off setting: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``; unset or empty: ``default``.

    :raises SelectionError: for any other value, naming the setting and the accepted values.
    """
    raw = (os.environ if environ is None else environ).get(name)
    value = "" if raw is None else raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise SelectionError(
        f"{name}={raw!r} is not a switch; set it to 1 (on) or 0 (off), or unset it (also accepted: "
        "true/false, yes/no, on/off)"
    )


def check_switches(environ: Mapping[str, str] | None = None) -> None:
    """Refuse an invalid value of any core switch (:data:`SWITCHES`) that is set, whatever mode is on.

    :raises SelectionError: naming the first such setting and the values it accepts.
    """
    for name in SWITCHES:
        read_switch(name, environ=environ)


def register_setting(name: str, meaning: str) -> None:
    """Declare another ``VLLM_PORT_*`` setting (a new feature's switch), so strict mode accepts it."""
    if not name.startswith("VLLM_PORT_"):
        raise ValueError(f"setting {name!r} must start with VLLM_PORT_")
    SETTINGS[name] = meaning


def strict_mode(strict: bool | None = None) -> bool:
    """Whether strict mode is on: ``strict`` if given, else ``VLLM_PORT_STRICT``.

    :raises SelectionError: when ``VLLM_PORT_STRICT`` holds something other than an on/off switch.
    """
    if strict is not None:
        return bool(strict)
    return read_switch(STRICT_ENV)


def fall_back(what: str, fix: str, *, strict: bool | None = None, record: list[str] | None = None) -> None:
    """Take a fallback the layer would take on its own: record ``what``, or refuse it in strict mode.

    :param what: what is skipped or replaced, by whom, and why (``"op 'rms_norm': provider 'x' of plugin
        'y' failed its check: ...; 'reference' serves instead"``).
    :param fix: how to make the fallback unnecessary (``"fix the provider, or deny the plugin: ..."``).
    :param record: where to append ``what`` when the fallback is taken (a part's ``fallbacks`` list).
    :raises StrictModeError: in strict mode, with ``what`` and ``fix``.
    """
    if strict_mode(strict):
        raise StrictModeError(
            f"strict mode ({STRICT_ENV}=1) refuses a fallback: {what}. {fix}; or unset {STRICT_ENV} to let "
            "vllm-port fall back and record it"
        )
    if record is not None:
        record.append(what)
    log.info("fallback: %s", what)


def unknown_settings(
    plugin_names: Iterable[str],
    environ: Mapping[str, str] | None = None,
    declared: Mapping[str, Collection[str]] | None = None,
) -> list[str]:
    """The ``VLLM_PORT_*`` variables set in ``environ`` that neither vllm-port nor an installed plugin reads.

    A plugin's own settings are named ``VLLM_PORT_<PLUGIN NAME>_*``: for a plugin in ``declared``
    (plugin name -> the settings it declares through ``vllm_port_settings``) only those it declares;
    for any other (not loaded, so its declaration is unknown), every name with its prefix.
    """
    env = os.environ if environ is None else environ
    declared = declared or {}
    undeclared = tuple(_prefix(name) for name in plugin_names if name not in declared)
    scoped = tuple(_prefix(name) for name in declared)
    known = set(SETTINGS).union(*declared.values())
    return sorted(
        name
        for name in env
        if name.startswith("VLLM_PORT_")
        and name not in known
        and (name.startswith(scoped) or not name.startswith(undeclared))
    )


def _prefix(plugin_name: str) -> str:
    return f"VLLM_PORT_{plugin_name.upper().replace('-', '_')}_"


def closest_setting(name: str, known: Iterable[str]) -> str | None:
    """The known setting ``name`` is most likely a misspelling of, or ``None`` when none is close."""
    found = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return found[0] if found else None


_warned: set[str] = set()


def warn_unknown_settings(names: Iterable[str], known: Iterable[str]) -> None:
    """Print one warning line per unknown setting (once per process), naming the closest known one."""
    known = sorted(known)
    for name in names:
        if name in _warned:
            continue
        _warned.add(name)
        guess = closest_setting(name, known)
        hint = f"did you mean {guess}? " if guess else ""
        log.warning(
            "vllm-port: unknown setting %s is ignored; %s(strict mode, %s=1, refuses it)", name, hint, STRICT_ENV
        )


def describe_unknown(names: list[str], known: Iterable[str] = ()) -> str:
    """One sentence naming unknown settings, the closest known one of each, and the known ones, for an error message."""
    known = sorted({*SETTINGS, *known})
    guesses = [f"{n} (did you mean {g}?)" if (g := closest_setting(n, known)) else n for n in names]
    return (
        f"unknown setting{'s' if len(names) > 1 else ''} {', '.join(guesses)} (vllm-port reads {', '.join(known)}, "
        "and a plugin the VLLM_PORT_<PLUGIN>_* variables it declares); fix the spelling or unset it"
    )
