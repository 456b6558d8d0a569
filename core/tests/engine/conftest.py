"""Engine test fixtures: tiny random checkpoints of each family (``core/tests/models/tiny_models.py``) with a
small byte-level BPE ``tokenizer.json`` beside them, and one CPU runtime for the session.

``engine_models`` maps each family to its directory; ``llama_model`` is the Llama one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
sys.path.insert(0, str(Path(__file__).parent.parent))

import cpu_runtime_fixtures
from llm_helpers import make_llm, prompts
from tiny_models import NEW_FAMILY_CONFIGS, TINY_CONFIGS, save_tiny_model

from vllm_port import SamplingParams

#: Special tokens first, so their ids are those of the tiny configs (bos 1, eos 2/3/4).
SPECIAL = ["<unk>", "<s>", "</s>", "<eot>", "<eos>"]
CORPUS = [
    "The sea was calm and the ships sailed out of the harbour at dawn.",
    "Once upon a time there lived a king who had three daughters.",
    "A quick brown fox jumps over the lazy dog; the dog sleeps on.",
    "Numbers like 12, 345 and 6789 appear here, with café and naïve.",
] * 4


def save_tokenizer(model_dir: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on a few sentences and save it as ``tokenizer.json`` (adds ``<s>`` first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


# the shared CPU fixtures, registered for this package (one_thread is autouse here only)
cpu_runtime = cpu_runtime_fixtures.cpu_runtime
one_thread = cpu_runtime_fixtures.one_thread


@pytest.fixture(scope="session")
def engine_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Family -> a tiny checkpoint directory with a tokenizer."""
    return {f: save_tokenizer(save_tiny_model(f, tmp_path_factory.mktemp(f"engine-{f}"))) for f in TINY_CONFIGS}


@pytest.fixture(scope="session")
def new_family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Family -> a tiny checkpoint of Qwen3, Qwen3-MoE or Mixtral with a tokenizer (``NEW_FAMILY_CONFIGS``)."""
    return {f: save_tokenizer(save_tiny_model(f, tmp_path_factory.mktemp(f"new-{f}"))) for f in NEW_FAMILY_CONFIGS}


@pytest.fixture(scope="session")
def llama_model(engine_models: dict[str, Path]) -> Path:
    return engine_models["llama"]


@pytest.fixture(scope="session")
def alone(llama_model, cpu_runtime):
    """Each prompt's greedy output when it runs by itself, and the prompts (sharing an 11-token prefix)."""
    shared = prompts([11], seed=7)[0]
    batch = [shared + p for p in prompts([3, 14, 1, 9], seed=8)] + prompts([21], seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = make_llm(llama_model, cpu_runtime, enable_prefix_caching=False)
    return batch, params, [llm.generate([p], params)[0].outputs[0].token_ids for p in batch]
