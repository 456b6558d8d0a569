"""The server's endpoints (FastAPI): OpenAI's completions, chat completions and models, health and metrics.

Each endpoint checks its request (pydantic, then :mod:`~vllm_port.serve.protocol`), submits it to
the :class:`~vllm_port.serve.async_engine.AsyncEngine` and answers its deltas, whole or as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``. Every error is an OpenAI
error object ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter or prompt
(naming it), 404 for an unknown model, 503 with ``Retry-After`` when the waiting queue is full.
A client that goes away, streaming or waiting for the whole answer, aborts its requests; their KV
blocks go back to the pool at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.chat_template import ChatTemplate, ChatTemplateError
from ..engine.llm import StreamOutput
from .async_engine import AsyncEngine, EngineFullError, RequestGroup, RequestRefusedError
from .metrics import CONTENT_TYPE
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParameterError,
    message_dicts,
    refuse_unsupported,
    sampling_params,
)

__all__ = ["OpenAIError", "build_app"]

#: Seconds a client told 503 is asked to wait before retrying.
RETRY_AFTER_S = 1
_TOOLS = "tool calling is not implemented"
_STRUCTURED = "structured output (constrained decoding) is not implemented"
#: OpenAI's and vLLM's request fields this server knows of and cannot honour, with why: refused like a
#: misspelt field, but not told to check its spelling.
UNSUPPORTED_FIELDS = {
    "tools": _TOOLS,
    "tool_choice": _TOOLS,
    "parallel_tool_calls": _TOOLS,
    "functions": _TOOLS,
    "function_call": _TOOLS,
    "tool_calls": _TOOLS,
    "tool_call_id": _TOOLS,
    "response_format": _STRUCTURED,
    "structured_outputs": _STRUCTURED,
    "guided_json": _STRUCTURED,
    "guided_regex": _STRUCTURED,
    "guided_choice": _STRUCTURED,
    "guided_grammar": _STRUCTURED,
    "guided_decoding_backend": _STRUCTURED,
    "chat_template_kwargs": "a request cannot pass its own values to the chat template",
    "chat_template": "a request cannot bring its own chat template (start the server with --chat-template FILE)",
    "documents": "a request cannot pass documents to the chat template",
    "audio": "audio output is not implemented",
    "modalities": "only text is generated",
    "prediction": "predicted outputs are not implemented",
}


class OpenAIError(Exception):
    """An error answered as OpenAI's error object with ``status``."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers: dict[str, str] = {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _bad_request(message: str, param: str | None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_value")


def build_app(engine: AsyncEngine, served_model_names: list[str], chat_template: ChatTemplate | None = None) -> FastAPI:
    """The server's application over ``engine``, answering to ``served_model_names`` (the first is reported).

    :param chat_template: renders chat messages; ``None``: the model's own (chat answers 400 without one).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="vllm-port", lifespan=lifespan)
    server = _Server(engine, served_model_names, chat_template)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        message = (
            f"no endpoint {request.method} {request.url.path}; see /v1/models, /v1/completions, /v1/chat/completions"
        )
        return OpenAIError(404, message, "invalid_request_error", None, "not_found").response()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = server.created
        max_len = engine.llm.max_model_len
        data = [
            {"id": n, "object": "model", "created": created, "owned_by": "vllm-port", "max_model_len": max_len}
            for n in served_model_names
        ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _unless_disconnected(request, server.complete(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _unless_disconnected(request, server.chat(body))

    return app


async def _unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """``answer``'s response, unless the client goes away first: then ``answer`` is cancelled, and its
    cleanup (:meth:`RequestGroup.aclose`) aborts the engine's requests for it, freeing their blocks now.

    A streamed answer returns at once (its response then watches the client itself); a whole one waits
    for its last token, and without this a client that left would still be served to the end.
    """
    handler = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((handler, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not handler.done():
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
        return Response(status_code=499)  # nobody is left to read it (nginx's "client closed request")
    return handler.result()


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (the body is read already: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint as a 400 naming the parameter."""
    error = exc.errors()[0]
    where = [str(part) for part in error.get("loc", ()) if part != "body"]
    param = where[0] if where else None
    path = ".".join(where) or "the body"
    if error.get("type") == "extra_forbidden" and where and where[-1] in UNSUPPORTED_FIELDS:
        message = f"{path!r} is not supported by this server: {UNSUPPORTED_FIELDS[where[-1]]}; leave it out"
    elif error.get("type") == "extra_forbidden":
        message = f"unknown field {path!r}: this server refuses fields it does not know (check the spelling)"
    else:
        message = f"{path}: {error.get('msg')} (got {error.get('input')!r:.80})"
    return _bad_request(message, param)


@dataclass
class _Choice:
    """One choice of a non-streamed answer, gathered from its deltas."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[tuple[int, Any]] = field(default_factory=list)


class _Server:
    """The endpoints' logic over one engine."""

    def __init__(self, engine: AsyncEngine, names: list[str], chat_template: ChatTemplate | None) -> None:
        self.engine, self.names = engine, names
        self.tokenizer = engine.llm.tokenizer
        self.chat_template = chat_template
        if chat_template is None and engine.llm.model_dir is not None:
            self.chat_template = ChatTemplate.from_model_dir(engine.llm.model_dir)
        self.created = int(time.time())

    def _check_model(self, model: str | None) -> str:
        if model is not None and model not in self.names:
            raise OpenAIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.names}",
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return model or self.names[0]

    async def _submit(self, prompts: list[Any], body: Any, max_tokens: int, prompt_param: str) -> RequestGroup:
        try:
            refuse_unsupported(body)
            params = sampling_params(body, max_tokens, self.engine.llm.sampling_defaults)
            return await self.engine.submit(prompts, params, getattr(params, "n", 1))
        except InvalidParameterError as exc:
            raise _bad_request(str(exc), exc.param) from None
        except RequestRefusedError as exc:
            raise _bad_request(str(exc).removeprefix("request 0: "), prompt_param) from None
        except EngineFullError as exc:
            error = OpenAIError(503, str(exc), "server_overloaded", None, "server_overloaded")
            error.headers["Retry-After"] = str(RETRY_AFTER_S)
            raise error from None
        except ValueError as exc:
            raise _bad_request(str(exc), None) from None

    # --- /v1/completions ------------------------------------------------------------------------

    async def complete(self, body: CompletionRequest) -> Response:
        model = self._check_model(body.model)
        prompts = _prompt_list(body.prompt)
        max_tokens = body.max_tokens if body.max_tokens is not None else self.engine.llm.max_model_len
        if "max_tokens" not in body.model_fields_set:  # OpenAI's 16, or less where the model says so
            max_tokens = min(max_tokens, self.engine.llm.sampling_defaults.get("max_tokens", max_tokens))
        group = await self._submit(prompts, body, max_tokens, "prompt")
        answer = _Answer("cmpl", "text_completion", model, body.n, body.logprobs is not None, self.tokenizer)
        if body.stream:
            return _sse(answer.stream(group, *_usage_options(body), _completion_delta))
        choices = await answer.gather(group)
        prompt_logprobs = body.prompt_logprobs is not None
        return JSONResponse(
            answer.envelope(
                [
                    {
                        "index": i,
                        "text": "".join(c.text),
                        "logprobs": _completion_logprobs(c.logprobs, self.tokenizer) if answer.logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        **({"prompt_logprobs": answer.prompt_logprobs(i)} if prompt_logprobs else {}),
                    }
                    for i, c in enumerate(choices)
                ],
                usage=answer.usage(group),
            )
        )

    # --- /v1/chat/completions -------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> Response:
        model = self._check_model(body.model)
        prompt_ids = self._render(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # what the context leaves, or less where the model says so
            left = max(1, self.engine.llm.max_model_len - len(prompt_ids))
            max_tokens = min(left, self.engine.llm.sampling_defaults.get("max_tokens", left))
        group = await self._submit([prompt_ids], body, max_tokens, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        answer = _Answer("chatcmpl", "chat.completion", model, body.n, body.logprobs, self.tokenizer, top)
        if body.stream:
            return _sse(answer.stream(group, *_usage_options(body), _chat_delta))
        choices = await answer.gather(group)
        more = {"prompt_logprobs": answer.prompt_logprobs(0)} if body.prompt_logprobs is not None else {}
        return JSONResponse(
            answer.envelope(
                [
                    {
                        "index": i,
                        "message": {"role": "assistant", "content": "".join(c.text)},
                        "logprobs": _chat_logprobs(c.logprobs, self.tokenizer, top) if body.logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                usage=answer.usage(group),
                **more,
            )
        )

    def _render(self, body: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt token ids (the chat template writes the special tokens)."""
        if self.chat_template is None:
            raise _bad_request(
                f"the model {self.engine.llm.model_dir} has no chat_template in its tokenizer_config.json, so "
                "chat messages cannot be rendered; start the server with --chat-template FILE, or use /v1/completions",
                "messages",
            )
        if self.tokenizer is None:
            raise _bad_request("chat needs the model's tokenizer.json, which this model lacks", "messages")
        try:
            text = self.chat_template.render(message_dicts(body.messages), body.add_generation_prompt)
        except InvalidParameterError as exc:
            raise _bad_request(str(exc), exc.param) from None
        except ChatTemplateError as exc:
            raise _bad_request(str(exc), "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)


def _usage_options(body: CompletionRequest | ChatCompletionRequest) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage_stats)`` of a streamed request's ``stream_options``."""
    options = body.stream_options
    return (False, False) if options is None else (options.include_usage, options.continuous_usage_stats)


def _prompt_list(prompt: Any) -> list[Any]:
    """``prompt`` as a list of prompts: text, token ids, or a list of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise _bad_request("prompt is empty; give text, token ids, or a list of those", "prompt")
    return list(prompt)


class _Answer:
    """The response of one API call: its id, envelope, chunks and usage."""

    def __init__(
        self, prefix: str, object: str, model: str, n: int, logprobs: bool, tokenizer: Any, top: int | None = None
    ) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.object, self.model, self.n = object, model, n
        self.logprobs, self.tokenizer, self.top = logprobs, tokenizer, top
        self.created = int(time.time())
        self.choice_tokens: dict[int, int] = {}  # choice index -> completion tokens so far
        self.text_offsets: dict[int, int] = {}  # choice index -> characters of its logprobs' tokens so far
        self._prompt_logprobs: dict[int, Any] = {}  # prompt index -> the engine's prompt logprobs

    def envelope(self, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **more}

    def usage(self, group: RequestGroup) -> dict[str, int]:
        return _usage(sum(len(ids) for ids in group.prompt_token_ids), sum(self.choice_tokens.values()))

    def choice_index(self, prompt_index: int, delta: StreamOutput) -> int:
        return prompt_index * self.n + getattr(delta, "sample_index", 0)

    def prompt_logprobs(self, choice: int) -> list[dict[str, Any] | None] | None:
        """The prompt logprobs of ``choice``'s prompt as vLLM answers them: per prompt token (``None`` for the
        first), token id -> ``{"logprob", "rank", "decoded_token"}``."""
        found = self._prompt_logprobs.get(choice // self.n)
        if found is None:
            return None
        return [
            None
            if position is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for t, lp in position.items()
            }
            for position in found
        ]

    def _record(self, prompt_index: int, index: int, delta: StreamOutput) -> None:
        """Count ``delta``'s tokens, and keep its prompt logprobs."""
        self.choice_tokens[index] = self.choice_tokens.get(index, 0) + len(delta.token_ids)
        if getattr(delta, "prompt_logprobs", None) is not None:
            self._prompt_logprobs[prompt_index] = delta.prompt_logprobs

    def running_usage(self, group: RequestGroup, prompt_index: int, index: int) -> dict[str, int]:
        """The usage so far of one choice (its prompt's tokens and its own): a chunk's continuous usage, as vLLM's."""
        return _usage(len(group.prompt_token_ids[prompt_index]), self.choice_tokens.get(index, 0))

    async def gather(self, group: RequestGroup) -> list[_Choice]:
        choices = [_Choice() for _ in range(len(group.request_ids) * self.n)]
        try:
            async for prompt_index, delta in group:
                if delta.finish_reason == "error":
                    raise OpenAIError(500, str(delta.error), "internal_server_error", None, "engine_error")
                index = self.choice_index(prompt_index, delta)
                choice = choices[index]
                choice.text.append(delta.text)
                choice.token_ids += delta.token_ids
                choice.logprobs += _token_logprobs(delta)
                choice.finish_reason = delta.finish_reason or choice.finish_reason
                choice.stop_reason = getattr(delta, "stop_reason", None) or choice.stop_reason
                self._record(prompt_index, index, delta)
        finally:
            await group.aclose()
        return choices

    async def stream(
        self,
        group: RequestGroup,
        include_usage: bool,
        continuous_usage: bool,
        make_choice: Callable[[_Answer, int, StreamOutput, bool], Any],
    ) -> AsyncIterator[str]:
        """Server-sent events: one chunk per delta, the usage chunk when asked, then ``[DONE]``.

        With ``include_usage`` every chunk has a ``usage`` key, ``null`` but in the last one; with
        ``continuous_usage`` too, each chunk's is its choice's usage so far (as vLLM's).
        """
        started: set[int] = set()
        chunk_object = f"{self.object}.chunk" if self.object == "chat.completion" else self.object
        try:
            async for prompt_index, delta in group:
                if delta.finish_reason == "error":
                    yield _event(
                        OpenAIError(500, str(delta.error), "internal_server_error", None, "engine_error").body()
                    )
                    continue
                index = self.choice_index(prompt_index, delta)
                self._record(prompt_index, index, delta)
                choice = make_choice(self, index, delta, index not in started)
                started.add(index)
                chunk = {**self.envelope([choice]), "object": chunk_object}
                if include_usage:
                    chunk["usage"] = self.running_usage(group, prompt_index, index) if continuous_usage else None
                yield _event(chunk)
            if include_usage:
                yield _event({**self.envelope([]), "object": chunk_object, "usage": self.usage(group)})
            yield "data: [DONE]\n\n"
        finally:
            await group.aclose()


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _completion_delta(answer: _Answer, index: int, delta: StreamOutput, first: bool) -> dict[str, Any]:
    logprobs = None
    if answer.logprobs:  # text offsets go on from the choice's earlier chunks, as in the whole answer
        start = answer.text_offsets.get(index, 0)
        logprobs = _completion_logprobs(_token_logprobs(delta), answer.tokenizer, start)
        answer.text_offsets[index] = start + sum(len(token) for token in logprobs["tokens"])
    return {
        "index": index,
        "text": delta.text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
        "stop_reason": getattr(delta, "stop_reason", None),
    }


def _chat_delta(answer: _Answer, index: int, delta: StreamOutput, first: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
    logprobs = _chat_logprobs(_token_logprobs(delta), answer.tokenizer, answer.top) if answer.logprobs else None
    return {
        "index": index,
        "delta": message,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
        "stop_reason": getattr(delta, "stop_reason", None),
    }


def _token_logprobs(delta: StreamOutput) -> list[tuple[int, Any]]:
    """``(token id, {id: Logprob})`` per new token of ``delta`` (empty before the engine has logprobs)."""
    per_token = getattr(delta, "logprobs", None) or []
    return list(zip(delta.token_ids, per_token, strict=False))


def _token_text(token_id: int, logprob: Any, tokenizer: Any) -> str:
    decoded = getattr(logprob, "decoded_token", None)
    if decoded is not None:
        return str(decoded)
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def _ranked(candidates: dict[int, Any]) -> list[tuple[int, Any]]:
    return sorted(candidates.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))


def _completion_logprobs(tokens: list[tuple[int, Any]], tokenizer: Any, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``logprobs``: the tokens, their logprobs, the top candidates, text offsets
    (from ``offset``: a stream's chunk goes on from the last)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, candidates in tokens:
        text = _token_text(token_id, candidates.get(token_id), tokenizer)
        chosen = candidates.get(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob if chosen is not None else None)
        out["top_logprobs"].append({_token_text(t, lp, tokenizer): lp.logprob for t, lp in _ranked(candidates)})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(tokens: list[tuple[int, Any]], tokenizer: Any, top: int | None) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: per token its text, logprob, UTF-8 bytes and the ``top`` likeliest."""
    content = []
    for token_id, candidates in tokens:
        chosen = candidates.get(token_id)
        text = _token_text(token_id, chosen, tokenizer)
        ranked = [(t, lp) for t, lp in _ranked(candidates) if lp.rank is not None][: top or 0]
        content.append(
            {
                "token": text,
                "logprob": chosen.logprob if chosen is not None else None,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": (s := _token_text(t, lp, tokenizer)), "logprob": lp.logprob, "bytes": list(s.encode())}
                    for t, lp in ranked
                ],
            }
        )
    return {"content": content}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (a client that left included),
    so that its ``finally`` aborts the requests at once rather than when the generator is collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(events: AsyncIterator[str]) -> Response:
    return _EventStream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
