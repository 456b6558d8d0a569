"""Unmodified Hugging Face models: a ``transformers`` causal LM imported as a flat model of contract ops.

::

    hf = transformers.AutoModelForCausalLM.from_pretrained("path/to/model")
    model = vllm_port.importer.import_model(hf, runtime, torch.bfloat16)   # traced, rewritten, checked
    print(model.report.to_json())          # which subgraphs became which contract op, what stays native
    llm = LLM("path/to/model", importer="hf")                              # the engine runs it

See docs/importer.md.
"""

from __future__ import annotations

from ._piece import Mapped, PieceReport
from ._trace import ATTENTION_IMPLEMENTATION, ImporterError
from .imported_model import ImportedConfig, ImportedModel, ImportReport, import_model

__all__ = [
    "ATTENTION_IMPLEMENTATION",
    "ImportReport",
    "ImportedConfig",
    "ImportedModel",
    "ImporterError",
    "Mapped",
    "PieceReport",
    "import_model",
]
