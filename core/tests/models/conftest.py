"""Session fixtures: a saved tiny checkpoint of each supported family (see ``tiny_models``).

``llama_dir``, ``qwen2_dir``, ``mistral_dir``, and ``tiny_model_dirs`` (family -> directory).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TINY_CONFIGS, save_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Family -> a saved tiny checkpoint directory, for every supported family."""
    return {family: save_tiny_model(family, tmp_path_factory.mktemp(family)) for family in TINY_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["qwen2"]


@pytest.fixture(scope="session")
def mistral_dir(tiny_model_dirs: dict[str, Path]) -> Path:
    return tiny_model_dirs["mistral"]
