"""How ``LLM(..., importer="hf")`` and ``LLM(model=<transformers module>)`` get their imported model."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ._trace import ImporterError
from .imported_model import ImportedModel, import_model

__all__ = ["IMPORTERS", "import_for_engine", "load_hf_model"]

#: Importer names ``LLM(importer=...)`` accepts.
IMPORTERS = ("hf",)


def load_hf_model(model_dir: str | os.PathLike[str], dtype: torch.dtype | None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained(model_dir)`` in ``dtype`` (default: the checkpoint's), safetensors only.

    :raises ImporterError: when transformers cannot load the directory, with its reason.
    """
    try:
        import transformers
    except ImportError as exc:
        raise ImporterError(f"importer 'hf' needs transformers ({exc}); pip install transformers") from exc
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.fspath(model_dir), dtype=dtype or "auto", use_safetensors=True
        ).eval()
    except Exception as exc:
        raise ImporterError(
            f"importer 'hf': transformers could not load {os.fspath(model_dir)!r} as a causal LM "
            f"({type(exc).__name__}: {exc}); give a Hugging Face model directory with config.json and "
            "safetensors weights"
        ) from exc


def import_for_engine(
    model: Any,
    importer: str | None,
    runtime: Any,
    dtype: str | torch.dtype,
    resolve_dtype: Callable[[Any, torch.dtype], torch.dtype],
    tensor_parallel_size: int = 1,
) -> ImportedModel:
    """The imported model ``LLM`` runs: ``model`` a transformers module, or a directory loaded with transformers.

    :param resolve_dtype: ``LLM``'s rule for ``"auto"`` and dtype names, given the checkpoint's dtype.
    :raises ImporterError: for an unknown importer, tensor parallelism, or a model that cannot be imported.
    """
    if importer not in (None, *IMPORTERS):
        raise ImporterError(f"importer {importer!r} is unknown; use one of {', '.join(IMPORTERS)} (or None)")
    if tensor_parallel_size != 1:
        raise ImporterError(
            f"tensor_parallel_size={tensor_parallel_size} with an imported model: imported models run on one "
            "device; use tensor_parallel_size=1, or the core model definitions (importer=None)"
        )
    if isinstance(model, torch.nn.Module):
        checkpoint = next(model.parameters()).dtype
        return import_model(model, runtime, resolve_dtype(dtype, checkpoint))
    if model is None:
        raise ImporterError("importer 'hf' needs a model: a Hugging Face model directory or a transformers module")
    requested = None if dtype == "auto" else resolve_dtype(dtype, torch.float32)
    hf_model = load_hf_model(model, requested)
    return import_model(hf_model, runtime, resolve_dtype(dtype, next(hf_model.parameters()).dtype))
