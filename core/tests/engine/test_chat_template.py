"""Chat templates render as ``transformers``' ``apply_chat_template`` renders them (the oracle), in a sandbox."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from vllm_port.data import bundled_model_dir
from vllm_port.engine.chat_template import ChatTemplate, ChatTemplateError

#: A ChatML-style template using what real templates use: a system default, loop controls, tojson,
#: raise_exception, namespace, string methods, and the special tokens.
CHATML = """{%- set ns = namespace(system=false) -%}
{{ bos_token }}
{%- for message in messages %}
  {%- if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
  {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
    {{- raise_exception('unknown role ' + message['role']) }}
  {%- endif %}
  {%- if loop.first and not ns.system %}<|im_start|>system
You are helpful.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{% if message['role'] == 'tool' %}{{ message['content'] | tojson }}{% else %}{{ message['content'] | trim }}{% endif %}<|im_end|>
  {%- if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "What is the sea? ünïcödé"},
        {"role": "assistant", "content": "Water."},
        {"role": "user", "content": "And the sky?"},
    ],
    [{"role": "user", "content": "Use the tool"}, {"role": "tool", "content": {"answer": 42, "unit": "café"}}],
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(bundled_model_dir())


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("template", ["bundled", "chatml"])
def test_rendering_matches_transformers(hf_tokenizer, template: str, conversation: int, add_generation_prompt: bool):
    messages = CONVERSATIONS[conversation]
    source = None if template == "bundled" else CHATML
    if template == "bundled" and messages[-1]["role"] == "tool":
        pytest.skip("the bundled template takes system, user and assistant turns")
    ours = ChatTemplate.from_model_dir(bundled_model_dir(), source)
    want = hf_tokenizer.apply_chat_template(
        messages, chat_template=source, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.render(messages, add_generation_prompt) == want


def test_a_list_of_named_templates_uses_default(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "{{ eos_token }}DEFAULT"}]
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": named}))
    assert ChatTemplate.from_model_dir(model).render([{"role": "user", "content": "x"}]) == "</s>DEFAULT"
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(ChatTemplateError, match="without a 'default'"):
        ChatTemplate.from_model_dir(model)


def test_refusals_are_chat_template_errors() -> None:
    template = ChatTemplate.from_model_dir(bundled_model_dir())
    with pytest.raises(ChatTemplateError, match="roles are system, user and assistant; got robot"):
        template.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="each message is a dict"):
        template.render(["hello"])  # type: ignore[list-item]
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):  # the sandbox: no Python internals
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate("{% set x = messages.append({'role': 'user'}) %}")
    with pytest.raises(ChatTemplateError):  # immutable: a template cannot change what it is given
        mutate.render([{"role": "user", "content": "x"}])


def test_text_parts_render_as_their_text_and_other_parts_are_refused() -> None:
    """A content of parts renders as its text parts joined by newlines (vLLM's rendering for a text model), the
    same for ``LLM.chat`` and the server; an image part is refused, not written into the prompt as Python."""
    template = ChatTemplate(CHATML)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly"}]}]
    assert template.render(parts) == template.render([{"role": "user", "content": "Describe\nbriefly"}])
    assert template.render([{"role": "user", "content": None}]) == template.render([{"role": "user", "content": ""}])
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    with pytest.raises(
        ChatTemplateError, match=r"messages\[0\]\.content: only text parts .* got \{'type': 'image_url'"
    ):
        template.render([{"role": "user", "content": [{"type": "text", "text": "Describe"}, image]}])


def test_llm_chat_renders_tokenizes_and_generates_like_generate(cpu_runtime, tmp_path: Path) -> None:
    from vllm_port import LLM, SamplingParams

    llm = LLM(device=cpu_runtime, kv_cache_memory=2 << 20)
    hf = transformers.AutoTokenizer.from_pretrained(bundled_model_dir())
    messages = CONVERSATIONS[1]
    ids = llm.apply_chat_template(messages)
    assert ids == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids.count(0) == 1  # one <s>: the template writes it, encoding adds none
    params = SamplingParams(temperature=0, max_tokens=8)
    (chat,) = llm.chat(messages, params)
    (plain,) = llm.generate([ids], params)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
    assert chat.prompt == llm.apply_chat_template(messages, tokenize=False)
    assert len(llm.chat([messages, CONVERSATIONS[0]], params)) == 2
    assert llm.apply_chat_template(messages, chat_template="{{ messages[0]['content'] }}", tokenize=False) == (
        "  Be brief.  "
    )

    bare = tmp_path / "bare"
    shutil.copytree(bundled_model_dir(), bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="has no chat_template.*--chat-template FILE"):
        LLM(str(bare), device=cpu_runtime, kv_cache_memory=2 << 20).chat(messages, params)
