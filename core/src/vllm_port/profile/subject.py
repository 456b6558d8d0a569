"""The model a profile times, and what a profile must share with its baseline to be compared.

Loading the model (the core definition or an importer's), who built it, its identity (model shape,
dtype, batch shape, platform, device) and the versions a report was made with.
"""

from __future__ import annotations

import hashlib
import json
import platform as host_platform
from pathlib import Path
from typing import Any

import torch

from .schema import IMPORTERS, ProfileError

__all__ = ["identity", "importer_of", "load_profile_model"]


def _device_name(runtime: Any) -> str:
    probe = runtime.selected.probe
    if runtime.device.type != "cpu" and probe is not None and probe.devices:
        return probe.devices[0].name
    return host_platform.processor() or host_platform.machine()


def importer_of(model: Any) -> str | None:
    """The importer that made ``model``: ``"hf"`` for a ``transformers`` model imported by
    :func:`vllm_port.importer.import_model`, ``None`` for a core model definition."""
    from ..importer.imported_model import ImportedModel  # no transformers import: the importer loads it only to import

    return "hf" if isinstance(model, ImportedModel) else None


def load_profile_model(
    model_dir: str | Path, runtime: Any, dtype: torch.dtype | None = None, importer: str | None = None
) -> Any:
    """The model ``vllm-port profile MODEL_DIR [--importer hf]`` profiles, on ``runtime``'s device.

    :param dtype: default the checkpoint's.
    :param importer: ``None`` for the core model definition (``vllm_port.models.load_model``);
        ``"hf"`` to load the directory with ``transformers`` and import it as ``LLM(model_dir,
        importer="hf")`` does (traced, rewritten into contract ops, checked against transformers).
    :raises ProfileError: for an unknown importer; ``ModelLoadError`` or ``ImporterError`` for a
        directory that cannot be loaded or imported.
    """
    if importer is None:
        from ..models import load_config, load_model

        return load_model(model_dir, runtime.device, dtype or load_config(model_dir).dtype)
    if importer not in IMPORTERS:
        raise ProfileError(
            f"profile: importer {importer!r} is unknown; use one of {', '.join(IMPORTERS)}, or none for the core model"
        )
    from ..importer.engine import load_hf_model
    from ..importer.imported_model import import_model

    hf_model = load_hf_model(model_dir, dtype)
    # the imported model shares the module's weights; dropping the module frees those it fused (q/k/v, gate/up)
    return import_model(hf_model, runtime, dtype)


def identity(
    model: Any, runtime: Any, dtype: torch.dtype, batch: int, context: int, block_size: int | None = None
) -> dict[str, Any]:
    """What a profile must share with its baseline to be compared: model shape and who built it (the core
    definition or an importer), dtype, batch shape, platform.

    :param block_size: default the platform's ``kv_block_size``, as :func:`profile_model`'s.
    """
    c = model.config
    facts = {
        "architecture": c.architecture,
        "num_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        # an imported model's config has none (ImportedConfig reads attention sizes from the traced graph)
        "intermediate_size": getattr(c, "intermediate_size", None),
        "num_heads": c.num_heads,
        "num_kv_heads": c.num_kv_heads,
        "head_size": c.head_size,
        "vocab_size": c.vocab_size,
    }
    facts["fingerprint"] = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return {
        "model": facts,
        "importer": importer_of(model),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"batch": batch, "context": context, "block_size": block_size or runtime.platform.kv_block_size},
        "platform": runtime.platform.name,
        "device": _device_name(runtime),
    }


def _versions() -> dict[str, str]:
    from .. import __version__

    return {"vllm-port": __version__, "torch": torch.__version__}
