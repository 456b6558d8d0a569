"""``vllm-port serve`` driven by the official ``openai`` client: completions, chat, streaming, errors, metrics.

One server for the module, the bundled model on the CPU on 127.0.0.1, small on purpose (4 running
and 4 waiting requests at most, so that a test can fill the queue); the offline ``LLM`` of the same
model is the oracle for greedy outputs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator

import pytest

from vllm_port import LLM, SamplingParams
from vllm_port.bench.serve_load import ServerProcess, check_stream, read_metrics, start_server

pytest.importorskip("fastapi", reason="vllm-port serve needs the serve extra: pip install 'vllm-port[serve]'")
openai = pytest.importorskip("openai", reason="the tests drive the server with the official openai client")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.xdist_group("serve")  # one worker: the module's one server

PROMPT = "It is a truth universally acknowledged"
MESSAGES = [{"role": "user", "content": "Where is Mr Darcy?"}]


def _has(field_name: str) -> bool:
    return field_name in {f.name for f in dataclasses.fields(SamplingParams)}


#: The server's --max-num-seqs and --max-waiting: 8 requests at most in flight.
MAX_NUM_SEQS, MAX_WAITING = 4, 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--device", "cpu", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING), "--seed", "0"]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with start_server(args, log=log, env={**os.environ, "OMP_NUM_THREADS": "1"}) as process:
        yield process
    # start_server stopped it with SIGTERM, as systemd and Kubernetes do: a graceful end, status 0 (serve_command)
    assert process.process.returncode == 0, log.read_text()[-2000:]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(cpu_runtime) -> LLM:
    return LLM(device=cpu_runtime, kv_cache_memory=2 << 20)


def _metrics(server) -> dict[str, float]:
    return read_metrics(httpx.get(f"{server.base_url}/metrics").text)


def _settled(server, timeout_s: float = 20.0) -> dict[str, float]:
    """The metrics once no request runs or waits and the KV pool is back to full (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        idle = not m["vllm_port:num_requests_running"] and not m["vllm_port:num_requests_waiting"]
        if (idle and m["vllm_port:kv_cache_free_blocks"] == m["vllm_port:kv_cache_total_blocks"]) or (
            time.monotonic() > deadline
        ):
            return m
        time.sleep(0.05)


# --- the happy paths ----------------------------------------------------------------------------


@pytest.mark.slow
def test_models_health_and_the_engine_idles(server, client) -> None:
    (model,) = client.models.list().data
    assert model.id == "bundled" and model.owned_by == "vllm-port"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    _settled(server)
    with open(f"/proc/{server.pid}/stat") as f:  # no busy loop: an idle server burns no CPU
        before = sum(int(x) for x in f.read().split()[13:15])
    time.sleep(1.0)
    with open(f"/proc/{server.pid}/stat") as f:
        after = sum(int(x) for x in f.read().split()[13:15])
    assert after - before <= 5, f"{after - before} ticks of CPU in 1 s idle"


@pytest.mark.slow
def test_greedy_completion_equals_llm_generate(client, llm) -> None:
    got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=12, temperature=0)
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12))[0]
    (choice,) = got.choices
    assert choice.text == want.outputs[0].text and choice.finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.usage.completion_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12 and got.object == "text_completion"
    ids = client.completions.create(model="bundled", prompt=want.prompt_token_ids, max_tokens=12, temperature=0)
    assert ids.choices[0].text == choice.text
    both = client.completions.create(model="bundled", prompt=[PROMPT, "The sea"], max_tokens=4, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text.startswith(
        llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    )


def test_greedy_chat_equals_llm_chat(client, llm) -> None:
    got = client.chat.completions.create(model="bundled", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=10))[0]
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids) and got.object == "chat.completion"


def test_stop_strings_end_the_text(client, llm) -> None:
    full = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    word = full.split()[2]
    got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=16, temperature=0, stop=[word])
    assert got.choices[0].text == full[: full.index(word)] and got.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_completion(client) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model="bundled", prompt=PROMPT, max_tokens=16, seed=seed, temperature=1.0)

    first, again, other = sample(7), sample(7), sample(8)
    assert first.choices[0].text == again.choices[0].text != other.choices[0].text


def test_streamed_completion_chunks_are_well_formed_and_equal_the_whole(server, client) -> None:
    whole = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model="bundled",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * 9 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len({c.id for c in chunks}) == 1
    payload = {
        "model": "bundled",
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=payload) as response:  # the raw events
        assert response.headers["content-type"].startswith("text/event-stream")
        text, problem = check_stream(list(response.iter_lines()), 10)
    assert problem is None and text == whole.choices[0].text


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client) -> None:
    whole = client.chat.completions.create(model="bundled", messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="bundled",
            messages=MESSAGES,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    body = chunks[:-1]
    assert body[0].choices[0].delta.role == "assistant" and all(c.choices[0].delta.role is None for c in body[1:])
    assert "".join(c.choices[0].delta.content for c in body) == whole.choices[0].message.content
    assert body[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 8
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.slow
def test_n_2_gives_two_choices(client) -> None:
    got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=8, n=2, seed=3, temperature=1.0)
    assert sorted(c.index for c in got.choices) == [0, 1] and got.usage.completion_tokens == 16
    chat = client.chat.completions.create(model="bundled", messages=MESSAGES, max_tokens=6, n=2, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    streamed = list(client.completions.create(model="bundled", prompt=PROMPT, max_tokens=4, n=2, stream=True))
    assert {c.choices[0].index for c in streamed} == {0, 1}


def test_logprobs_are_the_engines(client, llm) -> None:
    """The server's logprobs are ``LLM.generate``'s (which core/tests/engine/test_sampling_features.py
    checks against ``log_softmax`` of ``transformers``' logits), in OpenAI's two shapes."""
    import torch

    got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0].outputs[0]
    for entries, token, served, top in zip(
        offline.logprobs, offline.token_ids, lp.token_logprobs, lp.top_logprobs, strict=True
    ):
        assert served == pytest.approx(entries[token].logprob, abs=1e-5)
        want = {e.decoded_token: e.logprob for e in entries.values() if e.rank <= 2}
        assert top == pytest.approx(want, abs=1e-5)
    assert all(len(top) >= 2 for top in lp.top_logprobs)
    assert all(
        max(top.values()) == pytest.approx(t, abs=1e-4)
        for top, t in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    assert all(t <= 0 for t in lp.token_logprobs) and sum(torch.tensor(lp.token_logprobs).exp() > 0) == 3
    chat = client.chat.completions.create(
        model="bundled", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4) for t in content)


def test_continuous_usage_puts_each_choices_usage_so_far_on_every_chunk(client) -> None:
    chunks = list(
        client.completions.create(
            model="bundled",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    prompt = chunks[-1].usage.prompt_tokens
    assert [c.usage.completion_tokens for c in chunks[:-1]] == [1, 2, 3, 4]
    assert all(
        c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chunks
    )
    with pytest.raises(openai.BadRequestError) as alone:  # it needs include_usage: nothing would change silently
        client.completions.create(
            model="bundled", prompt=PROMPT, max_tokens=2, stream=True, stream_options={"continuous_usage_stats": True}
        )
    assert alone.value.body["param"] == "stream_options" and "include_usage" in alone.value.body["message"]


def test_streamed_logprobs_text_offsets_go_on_across_chunks(client) -> None:
    whole = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1)
    chunks = list(
        client.completions.create(model="bundled", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, stream=True)
    )
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset and offsets == sorted(set(offsets))


def test_prompt_logprobs_are_answered_as_vllm_answers_them(client, llm) -> None:
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    got = client.completions.create(
        model="bundled", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    served = got.choices[0].model_extra["prompt_logprobs"]
    assert len(served) == len(offline.prompt_token_ids) and served[0] is None
    for position, want in zip(served[1:], offline.prompt_logprobs[1:], strict=True):
        assert {int(t): e["logprob"] for t, e in position.items()} == pytest.approx(
            {t: e.logprob for t, e in want.items()}, abs=1e-5
        )
    chat = client.chat.completions.create(
        model="bundled", messages=MESSAGES, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1
    with pytest.raises(openai.BadRequestError) as streamed:  # vLLM refuses them too: the chunks have no place for them
        client.completions.create(
            model="bundled", prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert streamed.value.body["param"] == "prompt_logprobs"


def test_a_stop_string_at_the_last_allowed_token_is_a_stop_with_its_reason(client) -> None:
    full = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0)
    tokens = full.choices[0].logprobs.tokens
    word = tokens[3]  # completed by the fourth token, the last of max_tokens=4
    assert word.strip() and word not in "".join(tokens[:3]), tokens
    got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=4, temperature=0, stop=[word])
    choice = got.choices[0]
    assert choice.text == "".join(tokens[:3]) and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == word
    streamed = list(
        client.completions.create(model="bundled", prompt=PROMPT, max_tokens=4, temperature=0, stop=[word], stream=True)
    )
    assert (
        streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].choices[0].model_extra["stop_reason"] == word
    )


# --- errors ----------------------------------------------------------------------------------------


def _error(exc_info) -> dict:
    return exc_info.value.body if isinstance(exc_info.value.body, dict) else json.loads(exc_info.value.body)


def test_a_bad_parameter_is_a_400_naming_it(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="bundled", prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as typo:
        client.completions.create(model="bundled", prompt=PROMPT, extra_body={"max_token": 3})
    assert typo.value.body["param"] == "max_token" and "unknown field" in typo.value.body["message"]
    with pytest.raises(openai.BadRequestError) as kind:
        client.completions.create(model="bundled", prompt=PROMPT, max_tokens="many")  # type: ignore[arg-type]
    assert kind.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as role:
        client.chat.completions.create(model="bundled", messages=[{"role": "robot", "content": "beep"}])
    assert role.value.body["param"] == "messages" and "robot" in role.value.body["message"]
    with pytest.raises(openai.BadRequestError) as top:  # OpenAI's rule, and vLLM's: not silently no logprobs
        client.chat.completions.create(model="bundled", messages=MESSAGES, max_tokens=2, top_logprobs=3)
    assert top.value.body["param"] == "top_logprobs" and "logprobs: true" in top.value.body["message"]
    for zero in ({"max_completion_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 3}):
        with pytest.raises(openai.BadRequestError) as none:  # 0 is not "unset": the field sent is the one named
            client.chat.completions.create(model="bundled", messages=MESSAGES, **zero)
        assert none.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as tools:  # a real field this server cannot honour: no spelling advice
        client.chat.completions.create(
            model="bundled", messages=MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]
        )
    assert tools.value.body["param"] == "tools" and "tool calling is not implemented" in tools.value.body["message"]
    assert "spelling" not in tools.value.body["message"]


def test_vllm_extras_pass_through_or_are_refused_by_name(client, llm) -> None:
    got = client.completions.create(
        model="bundled",
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"top_k": 1, "ignore_eos": True, "repetition_penalty": 1.0, "stop_token_ids": [1]},
    )
    assert got.choices[0].text == llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
    extras = {"min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 3, "logit_bias": {"7": 2.0}}
    served = client.completions.create(
        model="bundled", prompt=PROMPT, max_tokens=6, temperature=0, presence_penalty=0.5, extra_body=extras
    )
    extras["logit_bias"] = {7: 2.0}
    offline = SamplingParams(temperature=0, max_tokens=6, presence_penalty=0.5, **extras)
    assert served.choices[0].text == llm.generate(PROMPT, offline)[0].outputs[0].text


def test_an_unknown_model_is_a_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_a_prompt_past_max_model_len_is_a_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="bundled", prompt=[5] * 600, max_tokens=2)
    assert long.value.body["param"] == "prompt" and "max_model_len is 512" in long.value.body["message"]


@pytest.mark.slow
def test_a_full_queue_is_a_503_with_retry_after_and_leaving_clients_free_their_blocks(server, client) -> None:
    before = _settled(server)
    payload = {"model": "bundled", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        streams = [http.stream("POST", "/v1/completions", json=payload) for _ in range(MAX_NUM_SEQS + MAX_WAITING)]
        responses = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            deadline = time.monotonic() + 10
            while _metrics(server)["vllm_port:num_requests_running"] < MAX_NUM_SEQS and time.monotonic() < deadline:
                time.sleep(0.02)  # until the batch runs (reading a stream here could close it)
            full = http.post("/v1/completions", json={**payload, "stream": False})
            assert full.status_code == 503 and full.headers["Retry-After"] == "1"
            assert full.json()["error"]["code"] == "server_overloaded"
            assert _metrics(server)["vllm_port:kv_cache_free_blocks"] < before["vllm_port:kv_cache_free_blocks"]
        finally:
            for s in streams:  # every client leaves mid-stream
                s.__exit__(None, None, None)
    after = _settled(server)
    assert after["vllm_port:kv_cache_free_blocks"] == before["vllm_port:kv_cache_free_blocks"]  # 0 leaked
    aborts = 'vllm_port:request_success_total{finished_reason="abort"}'
    assert after[aborts] - before.get(aborts, 0) == MAX_NUM_SEQS + MAX_WAITING
    assert client.completions.create(model="bundled", prompt=PROMPT, max_tokens=2).choices  # room again


def test_a_client_that_leaves_a_whole_answer_aborts_it(server) -> None:
    """Not only streams: a client waiting for a whole (non-streamed) answer that goes away aborts it."""
    before = _settled(server)
    payload = {"model": "bundled", "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(30, read=0.2)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=payload)  # leaves after 0.2 s, long before 480 tokens
    after = _settled(server)
    aborts = 'vllm_port:request_success_total{finished_reason="abort"}'
    assert after[aborts] - before.get(aborts, 0) == 1
    assert after["vllm_port:kv_cache_free_blocks"] == before["vllm_port:kv_cache_free_blocks"]
    generated = after["vllm_port:generation_tokens_total"] - before.get("vllm_port:generation_tokens_total", 0)
    assert generated < 480


def test_metrics_are_prometheus_text_with_the_vllm_port_names(server, client) -> None:
    client.completions.create(model="bundled", prompt=PROMPT, max_tokens=4, temperature=0)
    m = _settled(server)
    for name in [
        "vllm_port:time_to_first_token_seconds_count",
        "vllm_port:inter_token_latency_seconds_count",
        "vllm_port:e2e_request_latency_seconds_count",
        "vllm_port:prompt_tokens_total",
        "vllm_port:generation_tokens_total",
        "vllm_port:num_preemptions_total",
    ]:
        assert name in m, name
    assert m["vllm_port:time_to_first_token_seconds_count"] >= 1 and m["vllm_port:generation_tokens_total"] >= 4
    assert m["vllm_port:kv_cache_usage_perc"] == 0.0 and m["vllm_port:num_requests_running"] == 0
    assert m["vllm_port:num_requests_waiting"] == 0 and m["vllm_port:kv_cache_total_blocks"] > 0


@pytest.mark.slow
def test_a_small_load_run_passes_every_check(server) -> None:
    from vllm_port.bench.serve_load import LoadConfig, format_table, run_load

    report = run_load(
        server.base_url, server.pid, LoadConfig(requests=40, concurrency=8, rounds=1, prompts=8, warmup_rounds=0)
    )
    (result,) = report["rounds"]
    assert report["ok"], format_table(report)
    assert result["completed"] + result["disconnected"] == 40 and result["disconnected"] >= 1
    assert result["aborted"] == result["disconnected"] and result["leaked_blocks"] == 0


def test_the_readme_serve_example_runs(server, capsys) -> None:
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("\n## Serve") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{server.base_url}/v1")
    exec(compile(code, "README.md: Serve", "exec"), {})  # the README's own example, against this server
    assert len(capsys.readouterr().out.split()) >= 5


@pytest.mark.slow
def test_a_model_without_a_chat_template_is_a_400_until_one_is_given(cpu_runtime, tmp_path) -> None:
    import shutil

    from fastapi.testclient import TestClient

    from vllm_port.data import bundled_model_dir
    from vllm_port.engine.chat_template import ChatTemplate
    from vllm_port.serve.app import build_app
    from vllm_port.serve.async_engine import AsyncEngine

    bare = tmp_path / "bare"
    shutil.copytree(bundled_model_dir(), bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(bare), device=cpu_runtime, kv_cache_memory=2 << 20)
    body = {"model": "bare", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    with TestClient(build_app(AsyncEngine(llm, 4), ["bare"])) as http:
        refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and "--chat-template FILE" in refused.json()["error"]["message"]
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    with TestClient(build_app(AsyncEngine(llm, 4), ["bare"], ChatTemplate.from_file(template, bare))) as http:
        answered = http.post("/v1/chat/completions", json=body)
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("Where is Mr Darcy?\n"))


def test_the_models_generation_config_gives_the_defaults_a_request_leaves_out(cpu_runtime, tmp_path) -> None:
    """vLLM's ``--generation-config auto``: the file's ``top_k``/``max_new_tokens`` apply unless the request sets them."""
    import shutil

    from fastapi.testclient import TestClient

    from vllm_port.data import bundled_model_dir
    from vllm_port.serve.app import build_app
    from vllm_port.serve.async_engine import AsyncEngine

    model = tmp_path / "instruct"
    shutil.copytree(bundled_model_dir(), model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "top_k": 1, "max_new_tokens": 4}))
    llm = LLM(str(model), device=cpu_runtime, kv_cache_memory=2 << 20)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    with TestClient(build_app(AsyncEngine(llm, 4), ["instruct"])) as http:
        texts = {
            http.post("/v1/completions", json={"prompt": PROMPT, "seed": s}).json()["choices"][0]["text"]
            for s in (1, 2)
        }
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES}).json()
        own = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "top_k": 0, "seed": 1}).json()
    assert texts == {greedy}  # top_k 1 and 4 tokens from the file, whatever the seed
    assert chat["usage"]["completion_tokens"] == 4
    assert own["usage"]["completion_tokens"] == 6  # the request's own max_tokens and top_k win


@pytest.mark.slow
def test_an_asynchronously_scheduled_server_answers_what_the_synchronous_engine_does(cpu_runtime, llm) -> None:
    """``vllm-port serve --async-scheduling``'s engine behind the app, driven in process by the official client:
    greedy and seeded completions, several at once and streamed, equal to the synchronous ``LLM``'s; the KV
    pool is whole again afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from vllm_port.cli import build_parser
    from vllm_port.cli_flags import engine_kwargs
    from vllm_port.serve.app import build_app
    from vllm_port.serve.async_engine import AsyncEngine

    flags = engine_kwargs(build_parser().parse_args(["serve", "--async-scheduling", "--max-num-seqs", "4"]))
    ahead = LLM(device=cpu_runtime, kv_cache_memory=2 << 20, **flags)
    fed = []
    launch = ahead.runner.launch
    ahead.runner.launch = lambda batch, feed=None: fed.append(feed is not None) or launch(batch, feed)
    prompts = [PROMPT, "The sea", "Mr Bennet said", "It was"]
    greedy = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=9)
    want_seeded = llm.generate(PROMPT, seeded)[0].outputs[0].text
    with TestClient(build_app(AsyncEngine(ahead, 4), ["bundled"])) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)

        def complete(prompt: str) -> str:
            return (
                client.completions.create(model="bundled", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
            )

        with ThreadPoolExecutor(4) as pool:  # in flight together: one batch, steps launched ahead
            assert list(pool.map(complete, prompts)) == greedy
        streamed = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == greedy[0]
        got = client.completions.create(model="bundled", prompt=PROMPT, max_tokens=9, temperature=0.8, seed=7)
        assert got.choices[0].text == want_seeded
    assert any(fed)  # steps launched before the last one's tokens were read, their inputs fed on the device
    assert ahead.scheduler.pool.num_free == ahead.scheduler.pool.num_blocks
