"""The OpenAI request schemas the server takes (pydantic), and their mapping to ``SamplingParams``.

A field the schema does not know is refused (400 naming it), not ignored: a misspelt ``max_token``
must not silently generate 16 tokens. vLLM's extras (``top_k``, ``min_p``, ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ...) are accepted and passed to the ``SamplingParams`` field of
the same name; one that this engine's ``SamplingParams`` does not have is refused with a 400 that
says so, unless its value is the neutral one (``repetition_penalty: 1.0`` asks for nothing).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "InvalidParameterError",
    "StreamOptions",
    "message_dicts",
    "refuse_unsupported",
    "sampling_params",
]


class InvalidParameterError(ValueError):
    """A request parameter the server cannot honour; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # OpenAI's end-user id: recorded nowhere, accepted as OpenAI accepts it
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


#: Fields passed to ``SamplingParams`` under their own names: OpenAI's, and the extras a vLLM client sends.
_PASSED = (
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest, max_tokens: int, defaults: Mapping[str, Any] | None = None
) -> SamplingParams:
    """The ``SamplingParams`` a request asks for, generating at most ``max_tokens``.

    :param defaults: ``SamplingParams`` fields for what the request leaves out (or sends as ``null``): the
        model's ``generation_config.json`` (``LLM.sampling_defaults``), as vLLM applies them.
    :raises InvalidParameterError: naming the field that this engine cannot honour or that has a bad value.
    """
    given = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
    given.update((k, v) for k, v in request.model_dump(exclude_unset=True).items() if v is not None)
    if isinstance(request, ChatCompletionRequest):  # chat: logprobs is a switch, top_logprobs the count
        given["logprobs"] = (request.top_logprobs or 0) if request.logprobs else None
    if given.get("logit_bias"):
        given["logit_bias"] = _token_bias(given["logit_bias"])
    fields: dict[str, Any] = {name: given[name] for name in _PASSED if given.get(name) is not None}
    fields["max_tokens"] = max_tokens
    if fields.get("top_k") == 0:  # OpenAI-style clients send 0 for "no top-k"
        fields["top_k"] = -1
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        match = re.search(r"SamplingParams\.(\w+)", str(exc))
        param = match.group(1) if match else None  # the OpenAI fields carry SamplingParams' names
        raise InvalidParameterError(str(exc), param) from exc


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    """``logit_bias``'s keys are token ids written as strings (JSON object keys)."""
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise InvalidParameterError(
            f"logit_bias keys must be token ids (e.g. {{'50256': -100}}), got {sorted(bias)[:5]}", "logit_bias"
        ) from None


def refuse_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse the OpenAI fields this server accepts in the schema but cannot honour.

    :raises InvalidParameterError: naming the field.
    """
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise InvalidParameterError("echo is not supported; leave it out and prepend the prompt yourself", "echo")
        if request.suffix:
            raise InvalidParameterError("suffix is not supported (no fill-in-the-middle model)", "suffix")
        if request.best_of not in (None, request.n):
            raise InvalidParameterError(f"best_of must equal n ({request.n}) or be left out", "best_of")
    if request.stream_options is not None and not request.stream:
        raise InvalidParameterError("stream_options is only allowed when stream is true", "stream_options")
    options = request.stream_options
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise InvalidParameterError(
            "stream_options.continuous_usage_stats puts the usage so far on every chunk, which needs "
            "stream_options.include_usage: true as well",
            "stream_options",
        )
    if request.stream and request.prompt_logprobs is not None:
        raise InvalidParameterError(
            "prompt_logprobs are not available when stream is true; leave one of them out", "prompt_logprobs"
        )
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise InvalidParameterError("top_logprobs needs logprobs: true as well", "top_logprobs")
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(request, name)
            if value is not None and value < 1:
                raise InvalidParameterError(f"{name} must be at least 1, got {value}", name)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as dicts, as a chat template reads them (:func:`~vllm_port.engine.chat_template.text_conversation`
    turns a content of parts into its text, refusing any other part)."""
    return [message.model_dump(exclude_none=True) for message in messages]
