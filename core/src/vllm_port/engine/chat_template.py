"""Chat templates: a conversation rendered into one prompt, as ``transformers``' ``apply_chat_template`` renders it.

A model directory's ``tokenizer_config.json`` holds its ``chat_template``: a Jinja template (or a list
of named ones, of which ``"default"`` is used) that turns ``messages`` (``{"role", "content"}``
dicts) into the text the model was trained on. It is rendered in a sandboxed Jinja environment (a
template is data from the model's author, not code: it may not touch Python objects it is not
given), with the same settings, filters and names ``transformers`` gives it: ``trim_blocks``,
``lstrip_blocks``, the ``loopcontrols`` extension, ``tojson``, ``raise_exception``,
``strftime_now``, ``add_generation_prompt`` and the special tokens of the config (``bos_token``,
``eos_token``, ...). ``jinja2`` is imported when a template is first compiled.

::

    template = ChatTemplate.from_model_dir("path/to/model")   # None: the model has no template
    prompt = template.render([{"role": "user", "content": "Hello"}])
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

__all__ = ["TOKENIZER_CONFIG_FILE", "ChatTemplate", "ChatTemplateError", "Conversation", "text_conversation"]

#: The file of a model directory that holds its chat template and special tokens.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: The special tokens of ``tokenizer_config.json`` a template sees by name, as ``transformers`` passes them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: One conversation: messages, each a mapping with at least ``role`` and ``content``.
Conversation = Sequence[Mapping[str, Any]]


class ChatTemplateError(ValueError):
    """A chat template that is missing, cannot be compiled, or refuses a conversation (its ``raise_exception``)."""


def _special_token(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an added-token object with ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(value: Any, where: str) -> str:
    """The template text of a ``chat_template`` field: a string, or the ``"default"`` of a list of named ones."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateError(
            f"{where}: chat_template is a list of named templates {sorted(map(str, named))} without a 'default'; "
            "pass the one to use (--chat-template FILE, or LLM.chat(chat_template=...))"
        )
    raise ChatTemplateError(f"{where}: chat_template is {type(value).__name__}; it must be a string or a list")


@dataclass
class ChatTemplate:
    """A chat template and the special tokens it is rendered with.

    Attributes:
        source: the Jinja template text.
        special_tokens: the names a template reads (``bos_token``, ``eos_token``, ...), from the config.
        origin: where the template came from, for error messages.
    """

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = "the chat template"
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike[str], override: str | None = None) -> ChatTemplate | None:
        """The template of ``model_dir``'s ``tokenizer_config.json`` (``None`` when it has none), or ``override``.

        :param override: template text to use instead of the config's (its special tokens still come
            from the config).
        :raises ModelLoadError: for a ``tokenizer_config.json`` that is not a JSON object.
        """
        path = Path(model_dir) / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if path.is_file():
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{path}: cannot read it as JSON ({exc}); re-download or fix it") from exc
            if not isinstance(config, dict):
                raise ModelLoadError(f"{path}: holds {type(config).__name__}, not a JSON object")
        tokens = {name: t for name in SPECIAL_TOKENS if (t := _special_token(config.get(name))) is not None}
        if override is not None:
            return cls(override, tokens, "the given chat template")
        if config.get("chat_template") is None:
            return None
        return cls(_template_source(config["chat_template"], str(path)), tokens, f"{path}'s chat_template")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], model_dir: str | os.PathLike[str] | None = None) -> ChatTemplate:
        """The template in file ``path`` (a ``.jinja`` file), with ``model_dir``'s special tokens when given.

        :raises ChatTemplateError: when the file cannot be read.
        """
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"chat template {path}: cannot read it ({exc})") from exc
        template = cls.from_model_dir(model_dir, source) if model_dir is not None else cls(source)
        assert template is not None
        template.origin = f"chat template {path}"
        return template

    def render(self, messages: Conversation, add_generation_prompt: bool = True, **extra: Any) -> str:
        """``messages`` as one prompt, as ``transformers``' ``apply_chat_template(..., tokenize=False)`` renders them.

        :param add_generation_prompt: end with the tokens that start the assistant's turn.
        :param extra: more names the template may read (``tools``, ``documents``, ...).
        :raises ChatTemplateError: when the template cannot be compiled or refuses the conversation.
        """
        import jinja2

        messages = text_conversation(messages)
        try:
            compiled = self._compile()
            return str(
                compiled.render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **extra},
                )
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: {exc}") from exc

    def _compile(self) -> Any:
        if self._compiled is None:
            self._compiled = _environment().from_string(self.source)
        return self._compiled


def text_conversation(messages: Any) -> list[dict[str, Any]]:
    """``messages`` as a text model's template reads them: each ``content`` a string.

    A content of parts (OpenAI's ``[{"type": "text", "text": ...}, ...]``) becomes its text parts joined
    by newlines, as vLLM renders them for a text-only model; ``None`` becomes ``""``; any other content
    (text, or a value a template writes with ``tojson``) is passed as it is. A part of another kind (an
    image, audio) is refused: this engine runs text models, and leaving it out would answer a question
    the user did not ask.

    :raises ChatTemplateError: naming the message, or the part, that is not what a text model takes.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages is {messages!r:.80}; give a list of {{'role': ..., 'content': ...}} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ChatTemplateError(
                f"messages[{i}] is {message!r:.80}; each message is a dict with 'role' and 'content'"
            )
        content = message.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatTemplateError(
                        f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                        f"got {part!r:.80}"
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        out.append({**message, "content": "" if content is None else content})
    return out


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """``tojson`` as chat templates expect it: ``json.dumps`` without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> Any:
    """The sandboxed Jinja environment chat templates render in, set up as ``transformers`` sets up its own."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
