"""The rest of vLLM's offline API: stop reasons, stop strings kept, special tokens, dict prompts, metrics,
cached tokens, ``gpu_memory_utilization``, ``tokenizer=``, ``get_tokenizer``, ``use_tqdm``, hub ids.

References: ``tokenizers``' own ``decode`` for the text, the sizes' arithmetic for the KV budget.
"""

from __future__ import annotations

import shutil

import pytest
from llm_helpers import assert_pool_empty, make_llm, prompts
from tokenizers import Tokenizer as HfTokenizer

import vllm_port
from vllm_port import LLM, SamplingParams, TextPrompt, TokensPrompt
from vllm_port.cli import main
from vllm_port.engine import EngineConfig, RequestMetrics
from vllm_port.engine.sizing import activation_peak_bytes, memory_utilization_budget
from vllm_port.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from vllm_port.errors import ModelLoadError
from vllm_port.kv_pool import kv_block_bytes
from vllm_port.models import load_config

PROMPT = "The sea was calm"
FREE = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_model, cpu_runtime):
    return make_llm(llama_model, cpu_runtime)


@pytest.fixture(scope="module")
def free(llm):
    return llm.generate(PROMPT, FREE)[0].outputs[0]


def test_stop_reason_names_the_stop_string_or_token(llm, free):
    stop = free.text[5:8]
    by_text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "\x00"]))
    assert by_text[0].outputs[0].stop_reason == stop
    stop_id = free.token_ids[4]
    by_id = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    at_length = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert at_length.finish_reason == "length" and at_length.stop_reason is None


def test_stop_reason_is_none_for_end_of_sequence(llm):
    candidates = prompts([4] * 32, seed=11)
    runs = llm.generate(candidates, SamplingParams(temperature=0, max_tokens=64))
    ended = [o.outputs[0] for o in runs if o.outputs[0].finish_reason == "stop"]
    assert ended, "no end-of-sequence token in the tiny model's greedy outputs: pick other prompts"
    assert all(o.token_ids[-1] in (2, 3) and o.stop_reason is None for o in ended)


def test_include_stop_str_in_output_keeps_the_stop_string(llm, free):
    stop = free.text[5:8]
    kept = free.text[: free.text.index(stop) + len(stop)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.text == kept and out.stop_reason == stop
    assert "".join(d.text for d in llm.stream(PROMPT, params)) == kept


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_decodes_as_tokenizers_does(llama_model, skip):
    reference = HfTokenizer.from_file(str(llama_model / "tokenizer.json"))
    tokenizer = Tokenizer(llama_model / "tokenizer.json")
    prompt = reference.encode("Once upon a time").ids
    output = [*reference.encode("the king", add_special_tokens=False).ids, 2, 3, *reference.encode(" had").ids, 4]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    text = "".join(detok.take() for token in output if detok.feed(token) or True) + detok.flush()
    assert text == reference.decode(output, skip_special_tokens=skip)
    assert ("</s>" in text) is not skip


@pytest.mark.slow
def test_skip_special_tokens_reaches_the_output(llm, llama_model):
    reference = HfTokenizer.from_file(str(llama_model / "tokenizer.json"))
    candidates = prompts([4] * 32, seed=11)
    shown = SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False)
    for out in llm.generate(candidates, shown):
        ids = out.outputs[0].token_ids
        assert out.outputs[0].text == reference.decode(ids, skip_special_tokens=False)
    assert any("</s>" in o.outputs[0].text or "<eot>" in o.outputs[0].text for o in llm.generate(candidates, shown))


def test_dict_prompts_are_vllms_text_and_tokens_prompts(llm, free):
    ids = llm.get_tokenizer().encode(PROMPT)
    text, tokens = TextPrompt(prompt=PROMPT), TokensPrompt(prompt_token_ids=ids)
    outputs = llm.generate([text, tokens, {"prompt": PROMPT}], FREE)
    assert [o.outputs[0].token_ids for o in outputs] == [free.token_ids] * 3
    assert outputs[0].prompt == PROMPT and outputs[1].prompt is None and outputs[1].prompt_token_ids == ids
    assert llm.generate(tokens, FREE)[0].outputs[0].token_ids == free.token_ids  # one dict alone
    bad = llm.generate([{"prompt": PROMPT, "multi_modal_data": {}}], FREE)[0].outputs[0]
    assert bad.finish_reason == "error" and "'multi_modal_data'" in bad.error
    assert vllm_port.TextPrompt is TextPrompt and vllm_port.engine.TokensPrompt is TokensPrompt


def test_metrics_are_in_order_and_cached_tokens_counted(llama_model, cpu_runtime):
    llm = make_llm(llama_model, cpu_runtime, block_size=4)
    prompt = prompts([18], seed=12)[0]
    (first,) = llm.generate([prompt], FREE)
    m = first.metrics
    assert isinstance(m, RequestMetrics)
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue >= 0 and first.num_cached_tokens == 0
    (again,) = llm.generate([prompt], FREE)
    assert again.num_cached_tokens == 16  # four full blocks of 4; the last token is always computed
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_empty(llm)


def test_get_tokenizer_encodes_and_decodes(llm, llama_model):
    reference = HfTokenizer.from_file(str(llama_model / "tokenizer.json"))
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode(PROMPT) == reference.encode(PROMPT).ids
    assert tokenizer.decode(reference.encode(PROMPT).ids) == reference.decode(reference.encode(PROMPT).ids)


def test_a_tokenizer_from_elsewhere(llama_model, cpu_runtime, tmp_path, free):
    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    (model / "tokenizer.json").unlink()
    without = make_llm(model, cpu_runtime)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        without.get_tokenizer()
    for tokenizer in (llama_model, llama_model / "tokenizer.json"):
        llm = make_llm(model, cpu_runtime, tokenizer=str(tokenizer))
        assert llm.generate(PROMPT, FREE)[0].outputs[0].text == free.text
    with pytest.raises(ModelLoadError, match="is not a file; give a local directory holding a tokenizer.json"):
        make_llm(model, cpu_runtime, tokenizer=str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(tokenizer_mode="slow"), "tokenizer_mode is 'slow'; it must be 'auto'"),
        (dict(trust_remote_code=True), "never runs code from a model directory"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization is 1.5"),
        (dict(gpu_memory_utilization=0.5, kv_cache_memory=1 << 20), "give one of them"),
    ],
)
def test_vllm_arguments_refuse_what_they_cannot_honour(arguments, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**arguments)


def test_gpu_memory_utilization_sizes_the_cache_from_the_total(llama_model, cpu_runtime):
    _, total = cpu_runtime.allocator().mem_info()
    config = load_config(llama_model)
    activations = activation_peak_bytes(config, 4, 64, 4)
    weights = config.weight_bytes(config.dtype)
    utilization = (weights + activations + (1 << 20)) / total  # a MiB or so left for the cache
    llm = LLM(
        str(llama_model),
        device=cpu_runtime,
        gpu_memory_utilization=utilization,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        dtype="float32",
    )
    block_bytes = kv_block_bytes(config.num_layers, config.num_kv_heads, config.head_size, llm.runner.block_size, 4)
    budget = int(total * utilization) - weights - activations
    assert llm.runner.pool.num_blocks == budget // block_bytes > 0
    assert llm.generate(PROMPT, FREE)[0].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="leaves nothing for the KV cache after the weights"):
        LLM(str(llama_model), device=cpu_runtime, gpu_memory_utilization=weights / total / 2)


def test_gpu_memory_utilization_above_what_is_free_is_refused():
    with pytest.raises(ValueError, match="only 1.00 GiB is free now .*lower it to at most 0.250"):
        memory_utilization_budget(0.9, 1 << 30, 4 << 30, 1 << 20, 1 << 20, "host memory")
    assert memory_utilization_budget(0.5, 4 << 30, 4 << 30, 1 << 30, 1 << 29, "host memory") == 1 << 29


def test_use_tqdm_counts_prompts_done(llm):
    bars = []

    class Bar:
        def __init__(self, **options):
            self.options, self.n, self.closed = options, 0, False
            bars.append(self)

        def update(self, n):
            self.n += n

        def set_postfix_str(self, *a, **k):
            pass

        def close(self):
            self.closed = True

    llm.generate(prompts([5, 6, 7], seed=2), SamplingParams(max_tokens=4, n=2), use_tqdm=Bar)
    assert len(bars) == 1 and bars[0].options["total"] == 3 and bars[0].n == 3 and bars[0].closed
    llm.generate(prompts([5], seed=2), SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(bars) == 1


@pytest.mark.parametrize("model", ["meta-llama/Llama-3.2-1B", "Qwen/Qwen3-0.6B"])
def test_a_hub_id_says_only_local_directories_load(model, cpu_runtime):
    with pytest.raises(
        ModelLoadError, match=f"only local directories load .*huggingface-cli download {model} --local-dir DIR"
    ):
        LLM(model, device=cpu_runtime)


def test_a_hub_id_on_the_command_line(capsys):
    code = main(["generate", "--model", "org/name", "--device", "cpu", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and "only local directories load" in err and "hf download org/name" in err
