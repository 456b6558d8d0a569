"""Files shipped inside the ``vllm-port`` distribution: the bundled default model.

``bundled-model/`` is a Hugging Face directory (``config.json`` of ``LlamaForCausalLM``,
``model.safetensors``, ``tokenizer.json``, ``generation_config.json``, ``README.md``): a tiny Llama
trained on Jane Austen's novels (public domain) by ``dev/train_bundled_model.py``, so that
generation works offline with no download. Its ``README.md`` says how it was made.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ModelLoadError

__all__ = ["BUNDLED_MODEL_DIR", "bundled_model_dir"]

#: Where the bundled model lies in the installed package (it may be absent in a source tree).
BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled-model"


def bundled_model_dir() -> Path:
    """The bundled default model's directory.

    :raises ModelLoadError: when it is missing or incomplete (a source checkout without it, or a
        broken install); the message says how to rebuild it.
    """
    missing = [
        f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (BUNDLED_MODEL_DIR / f).is_file()
    ]
    if missing:
        raise ModelLoadError(
            f"bundled model: {BUNDLED_MODEL_DIR} lacks {', '.join(missing)}; reinstall vllm-port, or rebuild it with "
            "`python dev/train_bundled_model.py --text dev/data/austen.txt.xz` from a source checkout, "
            "or pass --model DIR"
        )
    return BUNDLED_MODEL_DIR
