"""Fixtures of the flat-graph tests: the CPU runtime and tiny saved checkpoints of each family.

The checkpoints come from ``core/tests/models/tiny_models.py`` (the models tests' builders), saved
once per session here as well: fixtures of a sibling folder's conftest are not visible in this one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))


@pytest.fixture(scope="session")
def cpu_runtime():
    import vllm_port

    return vllm_port.load(plugins="cpu")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Family -> a saved tiny Hugging Face checkpoint (Llama 3.1 rope, Qwen2 biases + tied, Mistral window)."""
    pytest.importorskip("transformers")
    from tiny_models import TINY_CONFIGS, save_tiny_model

    return {family: save_tiny_model(family, tmp_path_factory.mktemp(f"flat-{family}")) for family in TINY_CONFIGS}
