"""Debug mode's settings: ``VLLM_PORT_CHECK`` (the share of calls compared), its seed and the reproducer folder."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import SelectionError

__all__ = ["CHECK_DIR_ENV", "CHECK_ENV", "CHECK_SEED_ENV", "DEFAULT_CHECK_RATE", "CheckConfig", "check_config"]

CHECK_ENV = "VLLM_PORT_CHECK"
CHECK_DIR_ENV = "VLLM_PORT_CHECK_DIR"
CHECK_SEED_ENV = "VLLM_PORT_CHECK_SEED"
#: ``VLLM_PORT_CHECK=on``: one call in a hundred (besides each provider's first) is compared with the reference.
DEFAULT_CHECK_RATE = 0.01
DEFAULT_CHECK_DIR = "vllm-port-check"


@dataclass(frozen=True)
class CheckConfig:
    """Debug mode's settings: the share of calls compared, the seed that picks them, where reproducers go."""

    rate: float
    seed: int = 0
    directory: Path = Path(DEFAULT_CHECK_DIR)


def check_config(spec: str | None = None) -> CheckConfig | None:
    """Debug mode's settings from ``spec`` (else ``VLLM_PORT_CHECK``), or ``None`` when it is off.

    ``0``/``off``/empty: off; ``on``: :data:`DEFAULT_CHECK_RATE`; a number in (0, 1]: that share of
    calls (``1``: every call). ``VLLM_PORT_CHECK_SEED`` (default 0) and ``VLLM_PORT_CHECK_DIR``
    (default ``./vllm-port-check``) complete it.

    :raises SelectionError: for a rate or seed that is not one.
    """
    seed = _check_seed()  # read even when debug mode is off: an invalid seed is an error in every mode
    raw = (os.environ.get(CHECK_ENV, "") if spec is None else spec).strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw in ("on", "true", "yes"):
        rate = DEFAULT_CHECK_RATE
    else:
        try:
            rate = float(raw)
        except ValueError:
            rate = math.nan
        if not 0 < rate <= 1:
            raise SelectionError(
                f"{CHECK_ENV}={raw!r} is not a share of calls; give a number in (0, 1] (0.01: one call in a hundred, "
                f"1: every call), 'on' for {DEFAULT_CHECK_RATE}, or 0 to turn debug mode off"
            )
    return CheckConfig(rate, seed, Path(os.environ.get(CHECK_DIR_ENV) or DEFAULT_CHECK_DIR))


def _check_seed() -> int:
    seed_text = os.environ.get(CHECK_SEED_ENV, "0").strip() or "0"
    try:
        return int(seed_text)
    except ValueError:
        raise SelectionError(f"{CHECK_SEED_ENV}={seed_text!r} is not an integer seed") from None
