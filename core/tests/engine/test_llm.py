"""``LLM.generate`` end to end on the CPU plugin, fp32, tiny random checkpoints.

The oracle is ``transformers``' own ``generate`` on the same weights. A request's greedy output is
then held to its output alone: in a batch, with its prompt chunked, after a prefix-cache hit, and
after being preempted (recompute here; swap in ``test_reclaimer_plugins.py``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
from calling_capture import CallingCapture
from llm_helpers import assert_pool_empty, hf_greedy, make_llm, prompts, token_ids
from torch.multiprocessing.reductions import StorageWeakRef

from vllm_port import SamplingParams
from vllm_port.engine.runner import REPLAY_READ_FACTOR, flat_step
from vllm_port.errors import ModelLoadError
from vllm_port.flat import FlatModel
from vllm_port.ops.sampling import filled_truncation

FAMILIES = ["llama", "qwen2", "mistral"]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_generate(engine_models, cpu_runtime, family):
    model_dir = engine_models[family]
    llm = make_llm(model_dir, cpu_runtime)
    batch = prompts([7, 30, 12], seed=1)  # 30 + 64: past Mistral's window of 8 in prefill and decode
    outputs = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 64)
    assert_pool_empty(llm)


@pytest.mark.parametrize(
    "setup",
    [
        dict(),
        dict(max_num_batched_tokens=8, block_size=4),  # chunked prefill, prefill mixed with decode
        dict(max_num_seqs=2),  # requests join as others finish
    ],
    ids=["batched", "chunked-prefill", "joining"],
)
def test_greedy_output_does_not_depend_on_the_batch(llama_model, cpu_runtime, alone, setup):
    batch, params, want = alone
    llm = make_llm(llama_model, cpu_runtime, **setup)
    assert token_ids(llm.generate(batch, params)) == want
    assert_pool_empty(llm)


def test_greedy_output_does_not_change_with_prefix_cache_hits(llama_model, cpu_runtime, alone):
    batch, params, want = alone
    llm = make_llm(llama_model, cpu_runtime, block_size=4)
    first = token_ids(llm.generate(batch[:1], params))
    hits = llm.scheduler.pool.stats().hits
    assert first + token_ids(llm.generate(batch[1:], params)) == want
    assert llm.scheduler.pool.stats().hits - hits >= 3 * 2  # three more prompts hit the shared prefix's 2 blocks
    assert token_ids(llm.generate(batch, params)) == want  # everything cached: hits within one batch too
    assert_pool_empty(llm)


def test_greedy_output_does_not_change_after_preemption_by_recompute(llama_model, cpu_runtime, alone):
    batch, params, want = alone
    # 16 blocks of 4 tokens: the five requests need up to 14 blocks each at the end
    llm = make_llm(llama_model, cpu_runtime, block_size=4, kv_cache_memory=16 * 4096, max_model_len=64)
    assert llm.scheduler.pool.num_blocks == 16
    outputs = llm.generate(batch, params)
    assert token_ids(outputs) == want
    assert sum(o.num_preemptions for o in outputs) > 0 and outputs[0].num_preemptions == 0
    assert_pool_empty(llm)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(llama_model, cpu_runtime):
    batch = prompts([5, 9, 13], seed=3)
    llm = make_llm(llama_model, cpu_runtime, max_num_batched_tokens=6, block_size=4)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=100 + i) for i in range(3)]
    first = token_ids(llm.generate(batch, seeded))
    assert token_ids(llm.generate(batch, seeded)) == first  # again
    assert token_ids(llm.generate(batch[::-1], seeded[::-1])) == first[::-1]  # another batch order
    assert [token_ids(llm.generate([p], s))[0] for p, s in zip(batch, seeded, strict=True)] == first  # alone
    other = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=16, seed=7 + i) for i in range(3)]
    assert token_ids(llm.generate(batch, other)) != first
    assert first != token_ids(llm.generate(batch, GREEDY.__class__(temperature=0, max_tokens=16)))
    unseeded = SamplingParams(temperature=1.0, max_tokens=16)
    a, b = (token_ids(make_llm(llama_model, cpu_runtime, seed=5).generate(batch, unseeded)) for _ in range(2))
    assert a == b  # the engine's seed makes unseeded requests reproducible too
    assert_pool_empty(llm)


def test_a_step_that_truncates_nothing_passes_top_k_and_top_p_as_none(llama_model, cpu_runtime):
    # SamplingParams' defaults (top_k -1, top_p 1) and a top_k past the vocabulary truncate nothing: the engine
    # says so with None, which spares a GPU provider its sort; the draws equal those made with the tensors
    batch = prompts([5, 9, 13], seed=3)
    llm = make_llm(llama_model, cpu_runtime)
    vocab = llm.runner.model.config.vocab_size
    real, seen = llm.runner.ops.sample, []

    def spy(logits, temperature, top_k, top_p, seeds):
        seen.append((top_k is None, top_p is None))
        return real(logits, temperature, top_k, top_p, seeds)

    def filled(logits, temperature, top_k, top_p, seeds):  # what the engine passed before: always tensors
        top_k, top_p = filled_truncation(top_k, top_p, logits.shape[0], logits.device)
        return real(logits, temperature, top_k, top_p, seeds)

    cases = {
        "defaults": ([SamplingParams(temperature=1.0, max_tokens=6, seed=1)] * 3, {(True, True)}),
        "top_k past the vocabulary, a greedy row": (
            [SamplingParams(temperature=0.8, top_k=vocab + 5, max_tokens=6, seed=2), GREEDY] * 2,
            {(True, True)},
        ),
        "top_p": ([SamplingParams(temperature=1.0, top_p=0.8, max_tokens=6, seed=3)] * 3, {(True, False)}),
        "top_k on one row": (
            [SamplingParams(temperature=1.0, top_k=5, max_tokens=6, seed=4), SamplingParams(max_tokens=6, seed=5)] * 2,
            {(False, True)},
        ),
    }
    for label, (params, want) in cases.items():
        params = params[: len(batch)]
        seen.clear()
        llm.runner.ops.sample = spy
        got = token_ids(llm.generate(batch, params))
        assert set(seen) == want, label
        llm.runner.ops.sample = filled
        assert token_ids(llm.generate(batch, params)) == got, label
        llm.runner.ops.sample = real
    assert_pool_empty(llm)


def test_streaming_yields_the_same_tokens_and_text(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    requests = ["The sea was calm", prompts([6])[0], "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate(requests, params)
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    text: dict[int, str] = {0: "", 1: "", 2: ""}
    finished = []
    for delta in llm.stream(requests, params):
        assert delta.index not in finished, "a request went on after its last output"
        tokens[delta.index] += delta.token_ids
        text[delta.index] += delta.text
        if delta.finish_reason is not None:
            finished.append(delta.index)
    assert sorted(finished) == [0, 1, 2]
    for i, out in enumerate(want):
        assert tokens[i] == out.outputs[0].token_ids
        assert text[i] == out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    assert want[0].prompt == "The sea was calm" and want[0].prompt_token_ids[0] == 1  # <s> added
    assert_pool_empty(llm)


def test_closing_a_stream_early_aborts_its_requests(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    stream = llm.stream(prompts([8, 8]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.scheduler.has_unfinished()
    assert_pool_empty(llm)


def test_stop_strings_and_stop_token_ids(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    prompt = "The sea was calm"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    assert len(free.text) > 8, free
    stop = free.text[5:8]
    cut = free.text[: free.text.index(stop)]
    got = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "\x00"]))
    assert got[0].outputs[0].finish_reason == "stop" and got[0].outputs[0].text == cut
    streamed = "".join(d.text for d in llm.stream(prompt, SamplingParams(temperature=0, max_tokens=30, stop=stop)))
    assert streamed == cut  # nothing of the stop string leaked out while it was incomplete
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    by_id = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]


def test_one_decision_per_token_a_stop_string_before_the_length(llama_model, cpu_runtime):
    """The scheduler decides every stop: when the token completing a stop string is also the last
    ``max_tokens`` allows, the reason is ``stop`` with the string as ``stop_reason`` (as vLLM reports it),
    since the text is cut before the stop string either way."""
    llm = make_llm(llama_model, cpu_runtime)
    prompt = "The sea was calm"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = free.text[5:8]
    by_text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop))
    stopped = by_text[0].outputs[0]
    n = len(stopped.token_ids)
    at_length = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, stop=stop))
    last = at_length[0].outputs[0]
    assert stopped.finish_reason == last.finish_reason == "stop" and stopped.stop_reason == last.stop_reason == stop
    assert last.token_ids == stopped.token_ids and last.text == stopped.text == free.text[: free.text.index(stop)]
    assert_pool_empty(llm)


def test_eos_ends_a_request_unless_ignored(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    # a prompt whose greedy continuation meets an end-of-sequence id (2 or 3) within 64 tokens
    candidates = prompts([4] * 32, seed=11)
    runs = llm.generate(candidates, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    found = [
        (p, o.outputs[0].token_ids) for p, o in zip(candidates, runs, strict=True) if {2, 3} & {*o.outputs[0].token_ids}
    ]
    assert found, "no end-of-sequence token in the tiny model's greedy outputs: pick other prompts"
    prompt, ids = found[0]
    hits = [i for i, t in enumerate(ids) if t in (2, 3)]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[: hits[0] + 1]


def test_bad_requests_get_an_error_and_the_rest_complete(llama_model, cpu_runtime, alone):
    batch, params, want = alone
    llm = make_llm(llama_model, cpu_runtime, max_model_len=50)
    bad = [[1] * 50, "", [], [3, 512, 7, -1], [1, 2.5], None]
    outputs = llm.generate([batch[0], *bad, batch[1]], params)
    errors = [o.outputs[0] for o in outputs[1:-1]]
    assert [e.finish_reason for e in errors] == ["error"] * len(bad)
    assert "50 tokens; max_model_len is 50" in errors[0].error
    assert "empty" in errors[1].error and "empty" in errors[2].error
    assert "512 at 1, -1 at 3 outside the model's vocabulary [0, 512)" in errors[3].error
    assert "neither text nor a list of int token ids" in errors[4].error and errors[5].error
    assert [o.outputs[0].token_ids for o in (outputs[0], outputs[-1])] == want[:2]
    assert all(e.token_ids == [] and e.text == "" for e in errors)
    assert_pool_empty(llm)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, r"temperature is -0.5; it must be 0 \(greedy\) or a number in \[1e-05, 3.4e38\]"),
        ("top_p", 0.0, r"top_p is 0.0; it must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p is 1.5; it must be in \(0, 1\]"),
        ("top_k", -2, r"top_k is -2; it must be an int in \[-1, 2\*\*63 - 1\]"),
        ("max_tokens", 0, r"max_tokens is 0; it must be an int in \[1, 2\*\*63 - 1\]"),
        ("stop", [""], "stop is"),
        ("seed", -1, "seed is -1"),
    ],
)
def test_impossible_sampling_parameters_are_refused_before_anything_runs(
    llama_model, cpu_runtime, field, value, message
):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    llm = make_llm(llama_model, cpu_runtime)
    good = SamplingParams(max_tokens=4)
    changed = SamplingParams(max_tokens=4)
    setattr(changed, field, value)  # changed after it was made: generate checks again
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6], [7, 8]], [good, changed])
    assert not llm.scheduler.has_unfinished() and llm.scheduler.pool.stats().misses == 0  # nothing ran


def test_text_prompts_need_a_tokenizer(tmp_path, llama_model, cpu_runtime):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        (bare / f).write_bytes((llama_model / f).read_bytes())
    llm = make_llm(bare, cpu_runtime)
    text, ids = llm.generate(["hello", [5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert text.outputs[0].finish_reason == "error" and "no tokenizer.json" in text.outputs[0].error
    assert len(ids.outputs[0].token_ids) == 3 and ids.outputs[0].text == ""
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        llm.generate([[5]], SamplingParams(stop="x"))


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("no config", r"config.json: no config.json"),
        ("truncated weights", r"model.safetensors: not a readable safetensors file, corrupt or truncated"),
        ("no weights", r"no weights: expected model.safetensors"),
        ("corrupt tokenizer", r"tokenizer.json: cannot load the tokenizer"),
        ("not a directory", r"config.json: no config.json"),
    ],
)
def test_a_broken_model_directory_is_a_clear_load_error(tmp_path, llama_model, cpu_runtime, breakage, message):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in llama_model.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    if breakage == "no config":
        (broken / "config.json").unlink()
    elif breakage == "truncated weights":
        data = (broken / "model.safetensors").read_bytes()
        (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif breakage == "no weights":
        (broken / "model.safetensors").unlink()
    elif breakage == "corrupt tokenizer":
        (broken / "tokenizer.json").write_text("{not json")
    else:
        broken = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match=message):
        make_llm(broken, cpu_runtime)


def test_outputs_and_facts(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime)
    assert llm.platform == "cpu"
    assert llm.provider_per_op["linear"] and set(llm.provider_per_op) >= {"sample", "paged_attention"}
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out.prompt is None and out.prompt_token_ids == [5, 6, 7] and out.finished
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].index == 0  # the sample index (n=1)


def test_max_model_len_is_checked(llama_model, cpu_runtime):
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        make_llm(llama_model, cpu_runtime, max_model_len=10_000)
    with pytest.raises(Exception, match="exceeds the KV cache's"):
        make_llm(llama_model, cpu_runtime, max_model_len=256, kv_cache_memory=16 * 4096, block_size=4)
    llm = make_llm(llama_model, cpu_runtime, kv_cache_memory=16 * 4096, block_size=4)
    assert llm.max_model_len == 64  # what the cache holds, below max_position_embeddings


def test_the_block_size_defaults_to_the_platforms_and_bad_ones_are_refused(llama_model, cpu_runtime):
    assert make_llm(llama_model, cpu_runtime).runner.block_size == cpu_runtime.platform.kv_block_size == 16
    for bad in (0, -16, 16.0, True, "16"):
        with pytest.raises(ValueError, match="block_size is .* positive int"):
            make_llm(llama_model, cpu_runtime, block_size=bad)


def test_the_cache_holds_max_num_seqs_sequences_in_whole_blocks(llama_model, cpu_runtime):
    """8 sequences of 48 tokens take 8 blocks of 128 (one each), not the 3 their 384 tokens would fill."""
    llm = make_llm(llama_model, cpu_runtime, block_size=128, max_model_len=48, max_num_seqs=8, kv_cache_memory=0.5)
    assert llm.runner.pool.num_blocks == 8
    outs = llm.generate(prompts([16] * 8), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)


def test_the_step_function_is_a_seam(llama_model, cpu_runtime, alone):
    batch, params, want = alone
    calls = []

    class Flat:  # the shape of vllm_port.flat.FlatModel: forward and compute_logits without ops
        def __init__(self, runner):
            self.model, self.ops = runner.model, runner.ops

        def forward(self, input_ids, positions, kv_caches, meta):
            calls.append(meta.is_decode)
            return self.model.forward(self.ops, input_ids, positions, kv_caches, meta)

        def compute_logits(self, hidden):
            return self.model.compute_logits(self.ops, hidden)

    llm = make_llm(llama_model, cpu_runtime, make_step=lambda runner: flat_step(Flat(runner)))
    assert token_ids(llm.generate(batch, params)) == want
    assert True in calls and False in calls


def _flat_step(runner):  # what default_step gives on platforms that capture graphs
    return flat_step(FlatModel(runner.model, runner.runtime, compile=False, block_size=runner.block_size))


@pytest.mark.slow
@pytest.mark.parametrize("make_step", [None, _flat_step], ids=["model-forward", "flat-graphs"])
def test_decode_steps_replay_captured_graphs_where_the_platform_captures(
    llama_model, cpu_runtime, alone, monkeypatch, make_step
):
    batch, params, want = alone
    assert make_llm(llama_model, cpu_runtime).captured_batch_sizes == []  # the CPU plugin captures nothing
    monkeypatch.setattr(cpu_runtime, "graph_capture", CallingCapture)
    llm = make_llm(
        llama_model, cpu_runtime, max_num_seqs=12, max_num_batched_tokens=8, block_size=4, make_step=make_step
    )
    assert llm.captured_batch_sizes == [1, 2, 4, 8, 12]
    replays = []
    graphs = llm.runner.decode_graphs
    monkeypatch.setattr(graphs, "bucket", lambda n: replays.append(n) or type(graphs).bucket(graphs, n))
    # batches of every size up to len(batch), padded to the captured sizes; chunked prefill between them
    assert token_ids(llm.generate(batch, params)) == want
    assert len(replays) >= params.max_tokens - 1 and {1, len(batch)} <= set(replays)
    assert_pool_empty(llm)
    eager = make_llm(llama_model, cpu_runtime, enforce_eager=True)
    assert eager.captured_batch_sizes == [] and token_ids(eager.generate(batch, params)) == want


@pytest.mark.slow
@pytest.mark.parametrize("make_step", [None, _flat_step], ids=["model-forward", "flat-graphs"])
def test_prefill_and_mixed_steps_replay_captured_graphs_as_eager_steps_compute(
    llama_model, cpu_runtime, alone, monkeypatch, make_step
):
    """Steps up to the captured size in tokens replay the graphs, one row per token, and give the eager tokens.

    The budget of 16 tokens chunks the prompts (middle chunks sample nothing) and mixes them with decode
    rows; prefix hits start a prompt's rows past its cached blocks.
    """
    batch, params, want = alone
    monkeypatch.setattr(cpu_runtime, "graph_capture", CallingCapture)
    llm = make_llm(
        llama_model, cpu_runtime, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, make_step=make_step
    )
    assert llm.captured_batch_sizes == [1, 2, 4, 8, 16] and llm.runner.max_replayed_tokens == 16
    replayed, prefill_calls = [], []
    runner = llm.runner
    replay, step = runner._replay, runner.step
    monkeypatch.setattr(runner, "_replay", lambda b, *a: replayed.append(b) or replay(b, *a))

    def counted_step(input_ids, positions, kv_caches, meta, logits_rows):
        if not meta.is_decode:  # the graphs call the step as a decode step (paged attention); eager prefill not
            prefill_calls.append(meta)
        return step(input_ids, positions, kv_caches, meta, logits_rows)

    monkeypatch.setattr(runner, "step", counted_step)
    first = llm.generate(batch, params)
    again = llm.generate(batch, params)  # hits the first round's cached prefixes
    assert token_ids(first) == token_ids(again) == want
    assert sum(o.num_cached_tokens for o in again) > 0
    mixed = [b for b in replayed if not b.is_decode]
    assert prefill_calls == [] and mixed  # every step replayed, some of them prefill or mixed
    assert any(len(b.sample_rows) < len(b.query_lens) for b in mixed)  # a middle chunk among them
    assert any(1 in b.query_lens for b in mixed)  # decode rows beside a prefill chunk
    assert_pool_empty(llm)


@pytest.mark.parametrize("make_step", [None, _flat_step], ids=["model-forward", "flat-graphs"])
def test_a_closed_captured_engine_frees_its_weights_without_the_garbage_collector(
    llama_model, cpu_runtime, alone, monkeypatch, make_step
):
    """The captured graphs' replays hold the runner's step, which holds the runner: ``close()`` drops the graphs, so
    the weights go with the last reference to the engine. Left to the collector, they stayed on the device while
    a benchmark's next engine loaded beside them, which ran an 80 GiB H100 out of memory. The flat graphs (the
    default step where the platform captures) hold the weights too, as traced buffers of fx modules that sit in
    reference cycles with their graphs, as make_fx's tracer does: on an H100 5.8 MB stayed until ``gc.collect()``."""
    batch, params, want = alone
    monkeypatch.setattr(cpu_runtime, "graph_capture", CallingCapture)
    gc.collect()
    gc.disable()
    try:
        llm = make_llm(
            llama_model, cpu_runtime, max_num_seqs=4, max_num_batched_tokens=8, block_size=4, make_step=make_step
        )
        assert llm.captured_batch_sizes
        assert token_ids(llm.generate(batch[:2], params)) == want[:2]  # prefill traced too, where flat
        model = weakref.ref(llm.runner.model)
        weights = [weakref.ref(t) for t in (llm.runner.model.layers[0].qkv_weight, llm.runner.model.lm_head)]
        llm.close()
        del llm
        assert model() is None, [type(r).__name__ for r in gc.get_referrers(model())]
        assert all(w() is None for w in weights), [type(r).__name__ for w in weights for r in gc.get_referrers(w())]
    finally:
        gc.enable()


@pytest.mark.parametrize("make_step", [None, _flat_step], ids=["model-forward", "flat-graphs"])
def test_close_gives_the_kv_cache_back_while_the_engine_is_still_referenced(llama_model, cpu_runtime, alone, make_step):
    """``close()`` frees the cache's buffer at once, not with the engine's last reference: a closure or a list that
    still holds the engine must not keep its cache. (On an H100, a closed engine still referenced by a closure kept
    its 20 GB cache, and the next engine in the process ran out of memory mid-run.)"""
    batch, params, want = alone
    gc.collect()
    gc.disable()
    try:
        llm = make_llm(llama_model, cpu_runtime, max_num_batched_tokens=8, block_size=4, make_step=make_step)
        assert token_ids(llm.generate(batch[:2], params)) == want[:2]
        buffer = StorageWeakRef(llm.runner.kv.buffer.untyped_storage())  # dies with the last view of the buffer
        llm.close()
        assert buffer.expired()
        with pytest.raises(RuntimeError, match=r"close\(\) was called"):
            llm.generate(batch[:1], params)
    finally:
        gc.enable()


def test_an_engine_empties_its_allocators_cache_as_it_starts_and_as_it_closes(llama_model, cpu_runtime, monkeypatch):
    """Blocks a caching allocator holds for engines gone before count as free, yet a block goes back to the device
    only whole: an engine starts and closes with the cache emptied, so its KV cache is allocated from the device's
    memory. (On an H100 the fourth engine of one process could not allocate its 48 GiB cache with 62 GiB counted
    free.)"""
    allocator = cpu_runtime.allocator()
    emptied = []
    monkeypatch.setattr(allocator, "empty_cache", lambda: emptied.append(allocator.stats().live_buffers))
    before = allocator.stats().live_buffers  # other tests' engines may hold buffers of this runtime
    llm = make_llm(llama_model, cpu_runtime)
    assert allocator.stats().live_buffers > before
    assert emptied == [before]  # before this engine allocated anything
    llm.close()
    assert emptied == [before, before]  # after its cache went back


@pytest.mark.parametrize("ranks", [1, 2])
def test_tensor_parallel_ranks_own_their_devices_caches(llama_model, cpu_runtime, monkeypatch, ranks):
    """An engine of tensor-parallel ranks empties no allocator's cache as it starts: asking a GPU platform's allocator
    would open a device context in the process that starts the ranks (with ``external_launcher``, in every rank, before
    it has picked its device)."""
    import vllm_port.engine.llm as llm_module

    class OpenedError(Exception):
        pass

    def opened(*args, **kwargs):
        raise OpenedError  # the model opens right after the caches are emptied

    allocator = cpu_runtime.allocator()
    emptied = []
    monkeypatch.setattr(allocator, "empty_cache", lambda: emptied.append(ranks))
    monkeypatch.setattr(llm_module, "_open_model", opened)
    with pytest.raises(OpenedError):
        make_llm(llama_model, cpu_runtime, tensor_parallel_size=ranks)
    assert emptied == ([1] if ranks == 1 else [])


def test_a_prefill_step_reading_more_context_than_its_budget_runs_eagerly(llama_model, cpu_runtime, alone, monkeypatch):
    """One row per token reads each token's context again: past REPLAY_READ_FACTOR times the model's bytes (in
    keys and values) the step runs eagerly, through the prefill kernel; smaller chunks and decode steps still replay."""
    import json
    import math

    from safetensors import safe_open

    batch, params, want = alone
    monkeypatch.setattr(cpu_runtime, "graph_capture", CallingCapture)
    llm = make_llm(llama_model, cpu_runtime, max_num_seqs=4, max_num_batched_tokens=16, block_size=4)
    config = json.loads((llama_model / "config.json").read_text())
    with safe_open(str(llama_model / "model.safetensors"), "pt") as f:
        weights = sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # float32
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head * 4
    # the model's tensors: its weights, and its rotary table (a few percent here)
    factor = REPLAY_READ_FACTOR
    assert factor * weights // token <= llm.runner.max_replayed_context <= 1.05 * factor * weights // token
    llm.runner.max_replayed_context = 150  # a first chunk of 16 tokens reads 136, one ending at 20 reads 200
    assert token_ids(llm.generate(batch, params)) == want
    kinds = llm.runner.steps_by_kind
    assert kinds["eager"] > 0 and kinds["prefill replayed"] > 0 and kinds["decode replayed"] > 0, kinds


def test_interleaved_calls_each_get_their_own_tokens(llama_model, cpu_runtime, alone):
    batch, params, want = alone
    llm = make_llm(llama_model, cpu_runtime)
    first, second = llm.stream(batch[:2], params), llm.stream(batch[2:4], params)
    got: dict[tuple[int, int], list[int]] = {}
    for call, delta in (0, next(first)), (1, next(second)), (0, next(first)):
        got.setdefault((call, delta.index), []).extend(delta.token_ids)
    middle = token_ids(llm.generate(batch[4:], params))  # runs while both streams are open
    for call, stream in enumerate((first, second)):
        for delta in stream:
            got.setdefault((call, delta.index), []).extend(delta.token_ids)
    assert middle == want[4:]
    assert [got[(0, 0)], got[(0, 1)], got[(1, 0)], got[(1, 1)]] == want[:4]
    assert_pool_empty(llm)
