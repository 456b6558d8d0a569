"""A step of decode rows ahead of prefill chunks: the decode rows go to ``paged_attention``, the chunks to
``prefill_attention`` (``AttentionMetadata.num_decodes``), and the logits stay ``transformers``' own.

The prefill kernels give every sequence whole tiles of queries, so on the GPU a decode row served by them cost
several times what the decode kernel takes for it (issue 30: 117 us a row on an H100, `engine-step-h100.md`).
"""

from __future__ import annotations

import pytest
import torch
from paged_harness import Conversation, assert_fp32_close, hf_logits

from vllm_port.flat import StepInputs
from vllm_port.flat.flat_graph import contract_op
from vllm_port.flat.flat_model import FlatModel
from vllm_port.models import load_model
from vllm_port.models.llama import decode_rows_first

FAMILIES = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {family: load_model(tiny_dirs[family], torch.device("cpu"), torch.float32) for family in FAMILIES}


def _first_and_mixed(talk: Conversation, decoders: int):
    """Two steps: the decoders' whole prompts and the others' first halves; then the decoders' next token each
    (teacher-forced) ahead of the others' second halves. Returns both steps' ``(ids, positions, meta)`` for
    ``num_decodes`` given later, and the second step's expected logits."""
    n = len(talk.seqs)
    first = [talk.prompts[i] if i < decoders else talk.prompts[i] // 2 for i in range(n)]

    def step(starts, ends, num_decodes):
        positions = [torch.arange(s, e) for s, e in zip(starts, ends, strict=True)]
        ids = torch.cat([talk.seqs[i][p] for i, p in enumerate(positions)])
        slots = torch.cat([talk._slots(i, p) for i, p in enumerate(positions)])
        lens = [e - s for s, e in zip(starts, ends, strict=True)]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        meta = StepInputs(
            slots, talk.tables, torch.tensor(ends, dtype=torch.int32), cu, max(lens), False, num_decodes=num_decodes
        )
        return ids, torch.cat(positions), meta

    ends = [talk.prompts[i] + 1 if i < decoders else talk.prompts[i] for i in range(n)]
    expected = torch.cat(
        [hf_logits(talk.model_dir, tuple(talk.seqs[i].tolist()))[first[i] : ends[i]] for i in range(n)]
    )
    return (lambda: step([0] * n, first, 0)), (lambda num_decodes: step(first, ends, num_decodes)), expected


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_rows_ahead_of_prefill_chunks_give_transformers_logits_split_or_not(
    models, tiny_dirs, cpu_runtime, family
):
    model = models[family]
    ops = cpu_runtime.bind(torch.float32)
    got = {}
    for num_decodes in (0, 2):  # 0: prefill_attention serves every sequence, as before the split
        talk = Conversation(model.config, [9, 7, 12, 14], decode_steps=1, seed=3)
        talk.model_dir = tiny_dirs[family]
        first, mixed, expected = _first_and_mixed(talk, decoders=2)
        model.forward(ops, *first()[:2], talk.kv_caches, first()[2])
        ids, positions, meta = mixed(num_decodes)
        assert (decode_rows_first(meta) is None) == (num_decodes == 0)
        got[num_decodes] = model.compute_logits(ops, model.forward(ops, ids, positions, talk.kv_caches, meta))
        assert_fp32_close(got[num_decodes], expected)
    torch.testing.assert_close(got[2], got[0], atol=1e-5, rtol=1e-5)


def test_the_flat_prefill_graph_splits_and_serves_steps_with_and_without_decode_rows(models, tiny_dirs, cpu_runtime):
    model = models["mistral"]  # a sliding window: the decode kernel applies it to the decode rows
    flat = FlatModel(model, cpu_runtime, compile=False, block_size=4)
    nodes = [contract_op(n) for n in flat.graph("prefill").module.graph.nodes]
    assert nodes.count("paged_attention") == nodes.count("prefill_attention") == model.config.num_layers
    for decoders in (2, 0):  # one graph for both: num_decodes is a symbol of it
        talk = Conversation(model.config, [9, 7, 12, 14], decode_steps=1, seed=4)
        talk.model_dir = tiny_dirs["mistral"]
        first, mixed, expected = _first_and_mixed(talk, decoders=decoders)
        flat.forward(*first()[:2], talk.kv_caches, first()[2])
        ids, positions, meta = mixed(decoders)
        assert_fp32_close(flat.compute_logits(flat.forward(ids, positions, talk.kv_caches, meta)), expected)


def test_an_e4m3_cache_splits_the_same_way(models, tiny_dirs, cpu_runtime):
    """The ``*_fp8`` cache ops take the split too: decode rows through ``paged_attention_fp8``, equal to unsplit."""
    model = models["llama"]
    ops = cpu_runtime.bind(torch.float32)
    got = {}
    for num_decodes in (0, 2):
        talk = Conversation(model.config, [9, 7, 12, 14], decode_steps=1, seed=5)
        talk.model_dir = tiny_dirs["llama"]
        talk.kv_caches = [(k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)) for k, v in talk.kv_caches]
        first, mixed, _ = _first_and_mixed(talk, decoders=2)
        model.forward(ops, *first()[:2], talk.kv_caches, first()[2])
        ids, positions, meta = mixed(num_decodes)
        assert (decode_rows_first(meta) is None) == (num_decodes == 0)
        got[num_decodes] = model.compute_logits(ops, model.forward(ops, ids, positions, talk.kv_caches, meta))
        assert got[num_decodes].isfinite().all()
    # the same e4m3 keys and values read by either kernel (their closeness to float is test_kv_fp8.py's business)
    torch.testing.assert_close(got[2], got[0], atol=1e-5, rtol=1e-5)


def test_an_imported_model_takes_the_split_once_a_step_and_gives_transformers_logits(
    models, tiny_dirs, cpu_runtime, monkeypatch
):
    """An imported model serves decode rows ahead of prefill chunks as the core model does, and takes the split's
    offsets once for all its layers (one subtraction a step, not one a layer)."""
    import transformers

    import vllm_port.importer._contract as contract
    from vllm_port.importer import import_model

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    imported = import_model(hf, cpu_runtime)
    taken = []
    real = contract.decode_rows_first
    monkeypatch.setattr(contract, "decode_rows_first", lambda meta: taken.append(meta) or real(meta))
    ops = cpu_runtime.bind(torch.float32)
    got = {}
    for num_decodes in (0, 2):
        talk = Conversation(models["llama"].config, [9, 7, 12, 14], decode_steps=1, seed=3)
        talk.model_dir = tiny_dirs["llama"]
        first, mixed, expected = _first_and_mixed(talk, decoders=2)
        imported.forward(ops, *first()[:2], talk.kv_caches, first()[2])
        ids, positions, meta = mixed(num_decodes)
        taken.clear()
        got[num_decodes] = imported.compute_logits(ops, imported.forward(ops, ids, positions, talk.kv_caches, meta))
        assert taken == [meta], f"the split was taken {len(taken)} times in a step of {len(imported.layers)} layers"
        assert_fp32_close(got[num_decodes], expected)
    torch.testing.assert_close(got[2], got[0], atol=1e-5, rtol=1e-5)
