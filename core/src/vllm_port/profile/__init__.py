"""Layered profiling: every node of a model's decode and prefill steps, timed and grouped by the seeds' layers.

::

    report = profile_model(model, runtime, batch=8, context=256)      # JSON-ready dict
    print(render(report))                                              # graph, op providers, memory, comm
    result = compare(report, load_baseline("base.json"))               # what regressed, and by how much

``vllm-port profile [MODEL_DIR] [--importer hf] [--baseline F]`` is the same from the shell (exit 1 on
regression); ``profile_model(load_profile_model(model_dir, runtime, importer="hf"), runtime)`` profiles
the model ``LLM(model_dir, importer="hf")`` runs.
See docs/profile.md for what each number means and how to use a baseline in CI.
"""

from __future__ import annotations

import importlib
from typing import Any

from .compare import check_comparable, compare, load_baseline
from .render import render, render_comparison
from .schema import (
    DEFAULT_MIN_SHARE_PCT,
    DEFAULT_THRESHOLD_PCT,
    FORMAT,
    IMPORTERS,
    PHASES,
    SCHEMA_VERSION,
    STACK_LAYERS,
    ProfileError,
)

__all__ = [
    "DEFAULT_MIN_SHARE_PCT",
    "DEFAULT_THRESHOLD_PCT",
    "FORMAT",
    "IMPORTERS",
    "PHASES",
    "SCHEMA_VERSION",
    "STACK_LAYERS",
    "ProfileError",
    "check_comparable",
    "collective_name",
    "compare",
    "identity",
    "importer_of",
    "load_baseline",
    "load_profile_model",
    "profile_model",
    "render",
    "render_comparison",
]

#: Names served by the modules that load torch, the flat tracer and the profiler (name: module): imported
#: on first use, so ``vllm-port``'s argument parsing (which reads ``profile.profile_command``) stays fast.
_LAZY = {
    "collective_name": ".steps",
    "identity": ".subject",
    "importer_of": ".subject",
    "load_profile_model": ".subject",
    "profile_model": ".collect",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
