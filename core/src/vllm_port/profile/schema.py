"""The profile report's fixed names and defaults (light: the command line reads them without loading torch's tracer)."""

from __future__ import annotations

from ..errors import VllmPortError

__all__ = [
    "DEFAULT_MIN_SHARE_PCT",
    "DEFAULT_THRESHOLD_PCT",
    "FORMAT",
    "IMPORTERS",
    "PHASES",
    "SCHEMA_VERSION",
    "STACK_LAYERS",
    "ProfileError",
]

#: The ``format`` field of a profile report; ``version`` is :data:`SCHEMA_VERSION`.
FORMAT = "vllm-port-profile"
SCHEMA_VERSION = 1
#: The steps a profile can time (the flat graphs' phases, ``vllm_port.flat.PHASES``).
PHASES = ("decode", "prefill")
#: Importers ``profile --importer`` takes (``LLM(importer=...)``'s names; ``vllm_port.importer.engine.IMPORTERS``).
IMPORTERS = ("hf",)
#: The seeds' layers that take time in a step; memory (bytes) is the fourth group.
STACK_LAYERS = ("ops", "graph", "comm")
#: A time must grow by more than this percentage of the baseline's to count as a regression.
DEFAULT_THRESHOLD_PCT = 10.0
#: Changes smaller than this percentage of the baseline's step time are ignored.
DEFAULT_MIN_SHARE_PCT = 1.0


class ProfileError(VllmPortError):
    """A profile cannot be made or compared as asked; the message names the option or field and how to fix it."""
