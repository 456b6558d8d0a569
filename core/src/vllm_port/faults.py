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

import logging
import os
from collections.abc import Iterable, Mapping

from .errors import SelectionError, StrictModeError

__all__ = [
    "SETTINGS",
    "STRICT_ENV",
    "fall_back",
    "register_setting",
    "strict_mode",
    "unknown_settings",
]

STRICT_ENV = "VLLM_PORT_STRICT"
_ON = frozenset({"1", "true", "yes", "on"})
_OFF = frozenset({"", "0", "false", "no", "off"})

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
    "VLLM_PORT_GIT_COMMIT": "the commit a certification report names, where the tree has no .git",
    "VLLM_PORT_PLUGIN_GIT_COMMIT": "the commit of a plugin certified from outside this repository",
    "VLLM_PORT_CORE": "tox: the vllm-port checkout a generated plugin installs",
    "VLLM_PORT_CONFORMANCE": "tox: the conformance checkout a generated plugin installs",
    "VLLM_PORT_TORCH": "dev scripts: the torch build to install",
    "VLLM_PORT_CACHE_DIR": "where plugins cache built kernels",
}


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
    raw = os.environ.get(STRICT_ENV, "").strip().lower()
    if raw in _ON:
        return True
    if raw in _OFF:
        return False
    raise SelectionError(f"{STRICT_ENV}={raw!r} is not a switch; set it to 1 (strict) or 0 (fall back and record)")


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


def unknown_settings(plugin_names: Iterable[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``VLLM_PORT_*`` variables set in ``environ`` that neither vllm-port nor an installed plugin reads.

    A plugin's own settings are recognised by their prefix, ``VLLM_PORT_<PLUGIN NAME>_``.
    """
    env = os.environ if environ is None else environ
    prefixes = tuple(f"VLLM_PORT_{name.upper().replace('-', '_')}_" for name in plugin_names)
    return sorted(
        name for name in env if name.startswith("VLLM_PORT_") and name not in SETTINGS and not name.startswith(prefixes)
    )


def describe_unknown(names: list[str]) -> str:
    """One sentence naming unknown settings and the known ones, for an error message."""
    return (
        f"unknown setting{'s' if len(names) > 1 else ''} {', '.join(names)} (vllm-port reads {', '.join(sorted(SETTINGS))}, "
        "and a plugin its own VLLM_PORT_<PLUGIN>_* variables); fix the spelling or unset it"
    )
