"""The reference engine: ``LLM.generate`` over the portable layer, on whatever hardware is installed.

``config.py`` (``EngineConfig``: ``LLM``'s arguments as one value that checks itself), ``request.py``
and ``scheduler.py`` are device-free Python without torch (continuous batching, chunked prefill,
prefix caching, preemption by swap or recompute as the platform's reclaimer decides, stopping);
``runner.py`` is the only file that touches tensors, through the runtime; ``llm.py`` is the user
API. See docs/engine.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import EngineConfig
from .inputs import TextPrompt, TokensPrompt
from .logprobs import Logprob
from .sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AddedRequest",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StreamOutput",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    # llm.py (models, runner) loads on first use: the CLI reads engine.generate_command without it
    if name in __all__:
        return getattr(importlib.import_module(".llm", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
