"""``LLM`` and ``SamplingParams``: the user API, as vLLM users know it.

::

    from vllm_port import LLM, SamplingParams

    llm = LLM(model="path/to/model")                       # discover hardware, load, size the KV cache
    for out in llm.generate(["The sea", "Once upon"], SamplingParams(temperature=0, max_tokens=32)):
        print(out.outputs[0].text, out.outputs[0].finish_reason)
    for delta in llm.stream("The sea", SamplingParams(max_tokens=32)):   # tokens as they are produced
        print(delta.text, end="", flush=True)
        if "." in delta.text:
            llm.abort(delta.request_id)   # or close the stream: its blocks go back to the pool now

Bad requests do not stop a batch: a prompt that is empty, too long for ``max_model_len``, or holds
token ids outside the vocabulary (or is text when the model has no tokenizer) gets an output with
``finish_reason == "error"`` and the message in ``error``, and every other request runs. So does a
request whose logits hold NaN or Inf at some step, or whose sampled id is outside the vocabulary
(the message names the step and who is at fault: :mod:`vllm_port.engine.runner`). Bad
sampling parameters are the caller's code, not data: ``SamplingParams`` refuses them when made,
and ``generate`` checks them again before running anything (``ValueError``). A model directory that
cannot be loaded raises :class:`~vllm_port.errors.ModelLoadError` from ``LLM(...)``.
"""

from __future__ import annotations

import itertools
import numbers
import os
import random
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import bundled_model_dir
from ..errors import ModelLoadError, VllmPortError
from ..memory import host_memory
from ..models import load_config
from ..models.config import read_sampling_defaults
from ..models.loader import check_fits
from ..ops import FLOAT_DTYPES
from ..runtime import Runtime, load
from .chat_template import ChatTemplate, ChatTemplateError, Conversation
from .config import EngineConfig
from .inputs import Prompt, unpack_prompt
from .logprobs import Logprob
from .request import Request, sample_seed
from .runner import ModelRunner, PendingStep, StepFunction
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput, StepBatch, TopLogprobs
from .sizing import activation_peak_bytes, memory_utilization_budget
from .step_ahead import can_run_ahead, feed_rows
from .tokenizer import IncrementalDetokenizer, Tokenizer, open_tokenizer

__all__ = [
    "HOST_KV_CACHE_BYTES",
    "LLM",
    "AddedRequest",
    "CompletionOutput",
    "EngineConfig",
    "EngineError",
    "RequestMetrics",
    "RequestOutput",
    "StreamOutput",
]


class EngineError(VllmPortError):
    """The engine cannot go on (a step scheduled nothing while requests wait); a bug, reported with the state."""


@dataclass
class CompletionOutput:
    """What one sample of a request generated.

    Attributes:
        index: which of the request's ``SamplingParams.n`` samples this is (0 to n - 1), as in vLLM.
        text: the generated text (empty without a tokenizer), cut before a stop string (after it with
            ``include_stop_str_in_output``); special tokens left out unless ``skip_special_tokens=False``.
        token_ids: the generated token ids (a stop token, or the token completing a stop string, included).
        finish_reason: ``"stop"``, ``"length"``, ``"error"`` or ``"abort"``.
        error: what was wrong with the request, when ``finish_reason == "error"``.
        stop_reason: what stopped it: the stop token id (of ``stop_token_ids``) or the stop string;
            ``None`` for the model's end-of-sequence token, a length, an error or an abort (as vLLM).
        logprobs: with ``SamplingParams.logprobs``: per generated token, token id -> :class:`Logprob`
            (the top ones and the drawn token's, so ``logprobs`` or ``logprobs + 1`` entries).
        cumulative_logprob: with ``SamplingParams.logprobs``: the sum of the drawn tokens' logprobs.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    """When things happened to a request, as ``time.time()`` seconds (vLLM's ``RequestMetrics``' names).

    Attributes:
        arrival_time: the request was made (``generate``/``stream`` called).
        first_scheduled_time: its first step was scheduled (``None``: it never ran, e.g. a bad prompt).
        first_token_time: its first token (of any sample) was sampled.
        last_token_time: its latest token was sampled.
        finished_time: its last sample ended.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        """Seconds from arrival to the first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    """One request's prompt and its completions (``SamplingParams.n`` of them), as vLLM's ``RequestOutput``.

    Attributes:
        metrics: when it arrived, was scheduled, sampled its first and last tokens, and finished.
        num_cached_tokens: prompt tokens found in the prefix cache (not computed) when it was first scheduled.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token, token id ->
            :class:`Logprob` (the top ones and the prompt's own), ``None`` for the first token.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_preemptions: int = 0
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class StreamOutput:
    """New tokens of one sample of a request, as ``stream`` yields them; ``finish_reason`` is set on each
    sample's last one.

    Attributes:
        index: the request's position in the ``stream`` call.
        sample_index: which of the request's ``SamplingParams.n`` samples these tokens belong to.
        logprobs: with ``SamplingParams.logprobs``: one dict per token of ``token_ids``, as in
            :attr:`CompletionOutput.logprobs`.
        stop_reason: on a sample's last delta, as :attr:`CompletionOutput.stop_reason`.
        prompt_logprobs: on the last delta of a request's first sample, with
            ``SamplingParams.prompt_logprobs``: as :attr:`RequestOutput.prompt_logprobs`.
    """

    index: int
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    sample_index: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass(frozen=True)
class AddedRequest:
    """What :meth:`LLM.add_request` did with one request.

    Attributes:
        request_id: the id its deltas carry, for :meth:`LLM.abort_request`.
        prompt_token_ids: its prompt as token ids (empty when the prompt could not be read).
        error: why it was refused (an empty prompt, one past ``max_model_len``, ids outside the
            vocabulary); ``None`` when it was queued. A refused request yields no delta.
    """

    request_id: str
    prompt_token_ids: list[int]
    error: str | None = None


@dataclass
class _Call:
    """One open ``generate``/``stream`` call: its deltas not yet yielded, and its requests still unfinished.

    Counting (not scanning the requests) keeps a step's bookkeeping proportional to the step, not to
    the thousands of requests a call may hold.
    """

    outputs: deque[StreamOutput] = field(default_factory=deque)
    unfinished: int = 0


@dataclass
class _Submission:
    """One sample of one request of a call (a request of ``SamplingParams.n`` samples has n of them)."""

    index: int
    prompt: str | None
    seq: Request  # finish_reason "error": refused before scheduling
    detokenizer: IncrementalDetokenizer | None
    request_id: str  # the caller's id of the request (its samples' own ids differ: _sample_id)
    metrics: RequestMetrics  # shared by the request's samples
    text: list[str] = field(default_factory=list)
    call: _Call | None = None  # the call that yields this request's deltas, once it runs
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per output token, when asked for
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # per prompt token, when asked

    def delta(self, token_ids: list[int], text: str, logprobs: list[dict[int, Logprob]] | None = None) -> StreamOutput:
        seq = self.seq
        return StreamOutput(
            self.index, self.request_id, token_ids, text, seq.finish_reason, seq.error, seq.sample_index, logprobs
        )


class LLM:
    """A model loaded on the selected hardware, with a scheduler and a paged KV cache, ready to generate.

    The arguments are the fields of an :class:`~vllm_port.engine.EngineConfig`, checked as it is made
    (before anything loads); :meth:`from_config` builds the same engine from one.

    :param model: a Hugging Face model directory (config.json, safetensors, tokenizer.json); ``None``
        loads the bundled model.
    :param device: ``"auto"`` discovers installed plugins and selects the best available platform;
        a platform name (``"cpu"``, ``"cuda"``) selects that one; a :class:`~vllm_port.Runtime` is used as is.
    :param dtype: ``"auto"`` runs in the checkpoint's dtype; or ``"float32"``, ``"bfloat16"``,
        ``"float16"`` (or a ``torch.dtype``).
    :param tensor_parallel_size: devices to shard the model over (through the comm contract).
    :param max_model_len: the longest context (prompt and output); default: the model's
        ``max_position_embeddings``, or what the KV cache holds when that is less.
    :param kv_cache_memory: the KV cache's budget: a fraction in (0, 1] of the device memory free
        after the weights are loaded, or bytes; never more than ``max_num_seqs`` full contexts need.
        ``None`` (default): 0.8 of the free memory on a device platform; on a host platform
        (``device_type`` ``"cpu"``, where the cache shares memory with everything else)
        :data:`HOST_KV_CACHE_BYTES` (4 GiB), or 0.8 of the free host memory when that is less.
    :param block_size: tokens per KV-cache block; default: the platform's ``kv_block_size`` (16 on CPU,
        128 on CUDA, where attention loads whole key tiles from one block).
    :param max_num_seqs: the most requests running at once.
    :param max_num_batched_tokens: the token budget of a step (longer prompts are prefilled in chunks).
    :param enable_prefix_caching: reuse cached blocks of equal prompt prefixes across requests.
    :param swap_space: bytes of host memory to swap preempted requests to; ``None``: as much as the
        KV cache (at most 4 GiB) on platforms with a host memory tier, none elsewhere.
    :param seed: seeds the per-request seeds of requests that give none (``None``: fresh each run).
    :param plugins: allow/deny list of plugins for discovery (as ``VLLM_PORT_PLUGINS``).
    :param make_step: builds the runner's step function (:data:`~vllm_port.engine.runner.StepFunction`)
        from the runner, e.g. a compiled one; default: :func:`~vllm_port.engine.runner.default_step`.
    :param importer: ``"hf"`` loads ``model`` (a directory) with ``transformers`` and imports it
        (``vllm_port.importer``: docs/importer.md); ``model`` may also be a ``transformers`` module,
        imported as it is. Default ``None``: the core model definitions.
    :param enforce_eager: never replay captured graphs. By default steps are captured as device
        graphs per size on platforms that offer graph capture (the CUDA plugin does; the CPU plugin
        does not, and there every step runs as it is): decode steps of up to ``max_num_seqs``
        sequences, and prefill or mixed steps of up to
        :data:`~vllm_port.engine.config.MAX_CAPTURED_TOKENS` tokens (at most
        ``max_num_batched_tokens``); larger steps run eagerly, where the device's work outweighs
        the launches.
    :param placement: a placement policy (a ``.toml``/``.json`` file, a mapping or a
        :class:`~vllm_port.placement.PlacementPolicy`): the model's nodes on several platforms,
        run eagerly, without swap space by default (``docs/placement.md``).
    :param devices: the platforms to load for ``placement`` (the first holds the batch and samples);
        default: ``device`` and every platform the policy names.
    :param gpu_memory_utilization: as vLLM means it: the fraction in (0, 1] of the device's TOTAL
        memory this engine may use in all: the weights, the activations' peak (estimated from
        ``max_num_batched_tokens`` and ``max_num_seqs``) and the KV cache, which gets what remains.
        On a host platform it is a fraction of the host's total memory. Give it or ``kv_cache_memory``,
        not both; with neither, ``kv_cache_memory``'s default holds.
    :param tokenizer: a local directory holding a ``tokenizer.json``, or the file's path, to use
        instead of the model directory's own.
    :param tokenizer_mode: ``"auto"`` (or ``"hf"``): the ``tokenizer.json`` through the ``tokenizers``
        library, the only kind this engine reads.
    :param trust_remote_code: ``False`` only: the engine never runs code from a model directory.
    :param kv_cache_dtype: ``"auto"`` (the model's dtype) or ``"fp8"`` (``"fp8_e4m3"``): the paged KV cache in
        float8 e4m3 with scales of 1.0 (vLLM's default), a block taking half of bfloat16's bytes, so the same
        memory holds twice the tokens; attention reads it through the ``*_fp8`` cache ops.
    :param distributed_executor_backend: how the ``tensor_parallel_size`` (or ``pipeline_parallel_size``) ranks start: ``None`` or ``"mp"``
        spawns them on this machine; ``"external_launcher"`` (vLLM's name) makes this process one of the ranks
        that ``torchrun`` launched, on this machine or across several (``torchrun --nnodes``): every rank runs
        the same program and gets the same outputs (``docs/multi-node.md``).
    :param async_scheduling: schedule and launch each step before reading the previous step's tokens
        (vLLM's option of that name; :mod:`vllm_port.engine.step_ahead`): the host's work of a step overlaps
        the device's, with the same outputs token for token. Steps whose requests need their tokens on the host
        first (logits processing, logprobs, ``n > 1``) run synchronously. One device (``tensor_parallel_size=1``).
        ``None`` (the default, as vLLM's): on for one device of a platform where it was measured to pay
        (``"cuda"``: :data:`~vllm_port.engine.config.RUNS_AHEAD_BY_DEFAULT`) running a core model definition, off
        on a host platform (``"cpu"``, where it gains nothing), on platforms never measured and in the other
        modes; ``llm.runs_ahead`` says which.
    :param pipeline_parallel_size: stages to split the model's layers into, each a rank of its own with its
        layers and their KV cache (:mod:`vllm_port.engine.pipeline_parallel`), spawned on this machine or
        launched by ``torchrun`` (``distributed_executor_backend``): for a model whose weights do not fit one
        device. The stages take turns within a step, so it buys memory, not speed; its steps run eagerly, and
        it does not combine with ``tensor_parallel_size`` or placement yet.
    :param generation_config: where the requests' sampling defaults come from, as vLLM's option of that name:
        ``"auto"`` (the default) reads the model directory's ``generation_config.json`` (``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens`` as ``max_tokens``), ``"vllm"``
        takes ``SamplingParams()``'s own, a directory path reads that directory's file. A request's own fields
        always win; :meth:`get_default_sampling_params` shows the defaults.
    :raises ModelLoadError: for a model directory that cannot be loaded (naming the file and field).
    :raises SelectionError: for a device that is unknown or unavailable.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        device: str | Runtime = "auto",
        dtype: str | torch.dtype = "auto",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        kv_cache_memory: float | int | None = None,
        *,
        block_size: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        swap_space: int | None = None,
        seed: int | None = None,
        plugins: str | None = None,
        make_step: Callable[[ModelRunner], StepFunction] | None = None,
        enforce_eager: bool = False,
        importer: str | None = None,
        placement: Any = None,
        devices: Sequence[str] | None = None,
        gpu_memory_utilization: float | None = None,
        tokenizer: str | os.PathLike[str] | None = None,
        tokenizer_mode: str = "auto",
        trust_remote_code: bool = False,
        kv_cache_dtype: str = "auto",
        distributed_executor_backend: str | None = None,
        async_scheduling: bool | None = None,
        pipeline_parallel_size: int = 1,
        generation_config: str = "auto",
    ) -> None:
        arguments = dict(locals())  # exactly EngineConfig's fields (a test holds the two in step)
        del arguments["self"]
        self._start(EngineConfig(**arguments))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """The engine ``config`` describes: the same as ``LLM(...)`` with ``config``'s fields as arguments."""
        return cls(**config.as_arguments())

    def _start(self, config: EngineConfig) -> None:
        """Load the platform(s), open the model, build the runner and the scheduler that ``config`` asks for."""
        self.runtime, self.placement = _load_platforms(config)  # placement None: one platform
        #: the engine's settings as given (``async_scheduling=None`` stays ``None``: replacing a field and
        #: building again resolves it again, for the platform and mode that engine runs)
        self.engine_config = config
        #: whether steps run ahead of their tokens: ``async_scheduling`` as given, else resolved for the platform
        self.runs_ahead: bool = config.runs_ahead_on(self.runtime.platform.name)
        self._empty_caches()  # blocks cached for engines gone before count as free, yet go back only whole
        opened = _open_model(config, self.runtime)
        self.model_dir, self.config, self.dtype = opened.model_dir, opened.config, opened.dtype
        self.tokenizer = opened.tokenizer  # None: prompts are token ids, outputs carry no text
        #: ``SamplingParams`` fields a request that leaves them out takes (``generation_config``)
        self.sampling_defaults = _sampling_defaults(config.generation_config, self.model_dir)
        sizing = _size_cache(config, self.runtime, opened, self.placement)
        self.runner = _make_runner(config, self.runtime, opened, self.placement, sizing)
        # the cache's memory goes back to the allocator when the LLM goes away, closed or not
        self._finalizer = weakref.finalize(self, self.runner.close)
        capacity = self.runner.pool.num_blocks * sizing.block_size
        longest = min(self.config.max_position_embeddings, capacity, sizing.max_positions or capacity)
        self.max_model_len = config.max_model_len or longest
        try:
            self.scheduler = _make_scheduler(config, self.runtime, self.runner, self.max_model_len)
            #: the step sizes replayed from captured graphs, in rows: sequences of a decode step, tokens of
            #: any other (empty: every step eager)
            self.captured_batch_sizes = (
                []
                if config.enforce_eager or self.placement
                else self.runner.capture_steps(config.captured_rows, self.max_model_len, config.replayed_prefill_tokens)
            )
        except BaseException:
            self._finalizer()  # the cache back; what went wrong here is what the caller sees
            raise
        self._seeds = random.Random(config.seed)  # noqa: S311 - sampling seeds, not secrets
        self._ids = itertools.count()
        self._live: dict[str, _Submission] = {}  # requests of open generate/stream calls, by id
        # add_request's requests: one call holds all their deltas; per request id, its samples not yet finished
        self._core = _Call()
        self._added: dict[str, int] = {}
        #: the step launched ahead and not read yet (asynchronous scheduling): its output, batch and result
        self._ahead: tuple[SchedulerOutput, StepBatch, PendingStep] | None = None

    # --- facts -------------------------------------------------------------------------------------

    @property
    def platform(self) -> str:
        """The selected platform's name."""
        return self.runtime.platform.name

    @property
    def provider_per_op(self) -> dict[str, str]:
        """The provider bound to each op for the model's dtype."""
        return dict(self.runner.provider_per_op)

    def get_default_sampling_params(self) -> SamplingParams:
        """The ``SamplingParams`` a request without its own gets (vLLM's ``LLM.get_default_sampling_params``):
        ``SamplingParams()`` with the model's ``generation_config.json`` defaults (``generation_config``)."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self) -> Tokenizer:
        """The tokenizer that encodes prompts and decodes outputs (vLLM's ``LLM.get_tokenizer``).

        It offers ``encode(text) -> list[int]`` (with the special tokens the tokenizer adds, such as
        a beginning-of-sequence token), ``decode(token_ids, skip_special_tokens=True) -> str`` and
        ``vocab_size``: a ``tokenizer.json`` read by the ``tokenizers`` library, not a ``transformers``
        tokenizer object.

        :raises ValueError: when the model has no tokenizer (its prompts are token ids).
        """
        if self.tokenizer is None:
            raise ValueError(
                f"{self.model_dir or 'the imported module'} has no tokenizer.json (prompts are token ids); "
                "give LLM(tokenizer=DIR) to use one"
            )
        return self.tokenizer

    # --- generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the prompts' order, each with ``SamplingParams.n`` completions.

        :param prompts: a prompt or a list of them; a prompt is text, a list of token ids, or vLLM's
            ``{"prompt": text}`` / ``{"prompt_token_ids": ids}`` (:mod:`vllm_port.engine.inputs`).
        :param sampling_params: one for all prompts, or one per prompt (default
            :meth:`get_default_sampling_params`).
        :param use_tqdm: show a progress bar of the prompts done (and output tokens per second) on
            stderr, as vLLM does, but only when stderr is a terminal: logs, pipes and CI stay clean.
            A callable is used instead of ``tqdm.tqdm`` to make the bar (vLLM takes one too).
        :raises ValueError: for sampling parameters no request can run with, before anything runs.
        :raises KeyboardInterrupt: on Ctrl-C, once the step under way is done and every request's
            blocks are back in the pool (and swap space).
        """
        requests = self._requests(prompts, sampling_params)
        progress = _Progress(requests, use_tqdm)
        try:
            for delta in self._run(requests):
                progress.update(delta)
        finally:
            progress.close()
        return [self._output(list(samples)) for _, samples in itertools.groupby(requests, key=_prompt_index)]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[StreamOutput]:
        """Generate like :meth:`generate`, yielding each request's new tokens and text as each step produces them.

        Every request ends with one output whose ``finish_reason`` is set. Closing the iterator
        early aborts the requests still running (their blocks go back to the pool).
        """
        return self._run(self._requests(prompts, sampling_params))

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate the next turn of a conversation (or of each of a list of them), as vLLM's ``LLM.chat``.

        Each conversation (``[{"role": "user", "content": "..."}]``) is rendered with the model's chat
        template (:meth:`apply_chat_template`) and generated like :meth:`generate`; an output's
        ``prompt`` is the rendered text.

        :param chat_template: template text to use instead of the model's.
        :raises ChatTemplateError: when the model has no chat template and none is given, or the
            template refuses a conversation.
        """
        one = bool(messages) and isinstance(messages[0], Mapping)
        conversations = [messages] if one else list(messages)
        rendered = [
            self.apply_chat_template(c, chat_template, add_generation_prompt, tokenize=False) for c in conversations
        ]
        prompts = [self._tokenizer_for_chat().encode(text, add_special_tokens=False) for text in rendered]
        outputs = self.generate(prompts, sampling_params)
        for out, text in zip(outputs, rendered, strict=True):
            out.prompt = text
        return outputs

    def apply_chat_template(
        self,
        messages: Conversation,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
    ) -> Any:
        """One conversation rendered with the model's chat template (or ``chat_template``): its prompt
        token ids, or its text when ``tokenize`` is false (the template writes the special tokens; none is added).

        :raises ChatTemplateError: when the model has no chat template and none is given, or the
            template refuses the conversation.
        """
        if chat_template is not None:
            template = ChatTemplate.from_model_dir(self.model_dir, chat_template) if self.model_dir else None
            template = template or ChatTemplate(chat_template)
        else:
            template = self._model_chat_template()
        text = template.render(messages, add_generation_prompt)
        return self._tokenizer_for_chat().encode(text, add_special_tokens=False) if tokenize else text

    def _model_chat_template(self) -> ChatTemplate:
        cached = getattr(self, "_chat_template", None)
        if cached is None:
            cached = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir is not None else None
            if cached is None:
                raise ChatTemplateError(
                    f"the model {self.model_dir or self.config.architecture} has no chat_template in its "
                    "tokenizer_config.json, so a conversation cannot be rendered; pass one: "
                    "LLM.chat(..., chat_template=TEXT), or vllm-port serve --chat-template FILE"
                )
            self._chat_template = cached
        return cached

    def _tokenizer_for_chat(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ChatTemplateError(f"chat needs the model's tokenizer, and {self.model_dir} has no tokenizer.json")
        return self.tokenizer

    # --- internals ---------------------------------------------------------------------------------

    def _requests(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[_Submission]:
        self._check_open()
        listed = _as_prompt_list(prompts)
        per_prompt = _as_params_list(params, len(listed), self.get_default_sampling_params)
        for p in per_prompt:
            p.validate()
            if p.stop_strings and self.tokenizer is None:
                raise ValueError(
                    f"SamplingParams.stop {list(p.stop_strings)}: stop strings need the model's tokenizer, and "
                    f"{self.model_dir} has no tokenizer.json; use stop_token_ids"
                )
            if p.bad_words and self.tokenizer is None:
                raise ValueError(
                    f"SamplingParams.bad_words {p.bad_words!r:.100}: bad words need the model's tokenizer, and "
                    f"{self.model_dir} has no tokenizer.json; ban token ids with logit_bias (-100) instead"
                )
        requests = []
        for index, (prompt, p) in enumerate(zip(listed, per_prompt, strict=True)):
            requests += self._samples(index, str(next(self._ids)), prompt, p)
        return requests

    def _samples(self, index: int, request_id: str, prompt: Any, p: SamplingParams) -> list[_Submission]:
        """A request's ``p.n`` samples: the first is scheduled, the others fork from it once its prompt is computed."""
        metrics = RequestMetrics(time.time())
        prompt, problem = unpack_prompt(prompt)
        text = prompt if isinstance(prompt, str) else None
        ids: list[int] = []
        if problem is None:
            ids, problem = self._prompt_ids(prompt)
        problem = problem or _token_ids_problem(p, self.config.vocab_size)
        samples = []
        if problem is not None:
            metrics.finished_time = metrics.arrival_time
            for i in range(p.n):
                seq = Request(_sample_id(request_id, i), -1, ids, p)
                seq.sample_index, seq.finish_reason, seq.error = i, "error", f"request {index}: {problem}"
                samples.append(_Submission(index, text, seq, None, request_id, metrics))
            return samples
        stop_ids = [*(p.stop_token_ids or []), *([] if p.ignore_eos else self.config.eos_token_ids)]
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        bad_words = _bad_words_token_ids(self.tokenizer, p.bad_words) if p.bad_words else []
        for i in range(p.n):
            # the scheduler feeds the detokenizer each token, and stops the sample on a stop string it finds
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    ids,
                    p.stop_strings,
                    p.include_stop_str_in_output,
                    p.skip_special_tokens,
                    p.min_tokens,
                )
            seq = Request(_sample_id(request_id, i), int(request_id), ids, p, stop_ids, sample_seed(seed, i), detok)
            seq.sample_index = i
            if p.bad_words:
                seq.bad_words_token_ids = bad_words
            samples.append(_Submission(index, text, seq, detok, request_id, metrics))
        samples[0].seq.forks = [r.seq for r in samples[1:]]
        if p.prompt_logprobs is not None:  # the prompt is computed once, by the first sample
            samples[0].prompt_logprobs = [None] * len(ids)
        return samples

    def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None]:
        """The prompt's token ids, and what is wrong with it (``None`` when nothing is)."""
        if isinstance(prompt, _BYTES):  # a Sequence of ints, but text in some encoding, never token ids
            return [], (
                f"the prompt is {type(prompt).__name__} ({bytes(prompt)!r:.60}), which is never taken as token ids; "
                "decode it to text (prompt.decode('utf-8')) or pass a list of int token ids"
            )
        if isinstance(prompt, str):
            if not prompt:
                return [], "the prompt is empty; give at least one token"
            problem = _unicode_problem(prompt)
            if problem is not None:
                return [], problem
            if self.tokenizer is None:
                return [], f"a text prompt needs the model's tokenizer, and {self.model_dir} has no tokenizer.json"
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(_is_token_id(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            return [], f"prompt {prompt!r:.80} is neither text nor a list of int token ids"
        vocab = self.config.vocab_size
        if not ids:
            return ids, "the prompt is empty; give at least one token"
        outside = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab]
        if outside:
            shown = ", ".join(f"{t} at {i}" for i, t in outside[:5])
            return ids, f"token id(s) {shown} outside the model's vocabulary [0, {vocab})"
        if len(ids) >= self.max_model_len:
            return ids, (
                f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} (prompt and output), "
                "so at most {} prompt tokens fit; shorten it or raise max_model_len".format(self.max_model_len - 1)
            )
        return ids, None

    def _run(self, requests: list[_Submission]) -> Iterator[StreamOutput]:
        """Step the engine until ``requests`` are done, yielding their deltas.

        Several calls may be open at once (streams consumed in turns): each step serves every live
        request, and each delta waits in its own call's queue until that call yields it.
        """
        call = _Call()
        for r in requests:
            if r.seq.finish_reason == "error":
                call.outputs.append(r.delta([], ""))
        mine = self._enqueue(requests, call)
        try:
            while call.outputs or call.unfinished:
                if not call.outputs:
                    with _interrupt_after_step():
                        self._step()
                while call.outputs:
                    yield call.outputs.popleft()
        finally:
            for r in mine:
                if not r.seq.is_finished:
                    self.scheduler.finish(r.seq, "abort")
                self._live.pop(r.seq.request_id, None)
            if not self.scheduler.has_unfinished():
                self._drain()

    def _enqueue(self, requests: list[_Submission], call: _Call) -> list[_Submission]:
        """Schedule ``requests`` not refused, their deltas going to ``call``; return them."""
        mine = [r for r in requests if r.seq.finish_reason != "error"]
        for r in mine:
            r.call = call
            self._live[r.seq.request_id] = r
            if r.seq.sample_index == 0:  # the others fork from it (Request.forks)
                self.scheduler.add(r.seq)
        call.unfinished += len(mine)
        return mine

    # --- engine core: requests added and stepped by one caller (the server's engine thread) ------

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> AddedRequest:
        """Queue one request for :meth:`step`, as vLLM's ``LLMEngine.add_request``.

        The engine-core API beside ``generate``/``stream``: a server adds requests as they arrive,
        calls :meth:`step` while :meth:`has_unfinished_requests`, and routes each delta by its
        ``request_id``. Every call of it (and of ``step``, ``abort_request``) must come from one
        thread, the one that steps the engine.

        :return: the request's id and prompt tokens, or why it was refused (``error``; no delta follows).
        :raises ValueError: for sampling parameters no request can run with.
        """
        requests = self._requests([prompt], sampling_params)
        first = requests[0].seq
        refused = next((r.seq.error for r in requests if r.seq.finish_reason == "error"), None)
        if refused is not None:
            return AddedRequest(first.request_id, list(first.prompt_token_ids), refused)
        self._added[first.request_id] = len(self._enqueue(requests, self._core))
        return AddedRequest(first.request_id, list(first.prompt_token_ids))

    def step(self) -> list[StreamOutput]:
        """Run one engine step (when a request waits or runs); return the new deltas of every added request.

        A delta's ``request_id`` is the one :meth:`add_request` returned; each request's last delta has
        ``finish_reason`` set (``"abort"`` after :meth:`abort_request`).
        """
        if self.scheduler.has_unfinished():
            self._step()
        deltas = list(self._core.outputs)  # every sample's deltas carry its request's id (_Submission.delta)
        self._core.outputs.clear()
        for delta in deltas:  # the step's bookkeeping grows with its deltas, not with the requests added
            if delta.finish_reason is not None:
                self._live.pop(_sample_id(delta.request_id, delta.sample_index), None)
                self._added[delta.request_id] -= 1
                if not self._added[delta.request_id]:
                    del self._added[delta.request_id]
        return deltas

    def abort_request(self, request_id: str) -> bool:
        """End a request :meth:`add_request` queued: its blocks go back to the pool now, and the next
        :meth:`step` returns its last delta (``finish_reason == "abort"``).

        :return: whether it was unfinished (``False``: unknown, or already finished).
        """
        return request_id in self._added and self.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether a request added by :meth:`add_request` runs, waits, or has deltas :meth:`step` has not returned."""
        return bool(self._added)

    def abort(self, request_id: str) -> bool:
        """End a running request now, every sample of it: its blocks go back to the pool (its cached prefix stays cached).

        ``request_id`` is a :class:`StreamOutput`'s ``request_id``. Call it from the thread that
        consumes the stream, between deltas; the stream then yields the last output of each of the
        request's unfinished samples, with ``finish_reason == "abort"``, and goes on with the others
        (``generate`` reports them as aborted with the tokens they had).

        :return: whether the request was running (``False``: unknown, or already finished).
        """
        first = self._live.get(request_id)
        if first is None or first.call is None:
            return False
        samples = [self._live.get(_sample_id(request_id, i)) for i in range(first.seq.params.n)]
        running = [r for r in samples if r is not None and not r.seq.is_finished]
        for r in running:  # all ended before any delta: ending the first ends the samples waiting to fork from it
            self.scheduler.finish(r.seq, "abort")
        for r in running:
            text = r.detokenizer.flush() if r.detokenizer is not None else ""
            r.text.append(text)
            r.call.outputs.append(r.delta([], text))
            r.call.unfinished -= 1
        if running:
            first.metrics.finished_time = time.time()
        return bool(running)

    def _step(self) -> None:
        """One engine step: schedule, run, and queue each live request's new token for its call.

        With ``async_scheduling`` the step read is the one launched before (:mod:`.step_ahead`), and the
        next is launched first where it can be.
        """
        self._check_open()
        if not self.runs_ahead:
            out, batch = self._schedule()
            self._take_tokens(out, batch, self.runner.execute(batch))
            return
        if self._ahead is None:
            out, batch = self._schedule()
            self._ahead = (out, batch, self.runner.launch(batch))
        out, batch, pending = self._ahead
        self._ahead = None
        committed = can_run_ahead(out, batch, self.max_model_len)
        if committed:
            self.scheduler.commit(out, batch)
            try:
                self._launch_ahead(out, pending)
            except BaseException:  # step N's tokens still count: read them, then say what failed
                self._take_tokens(out, batch, pending.result(), committed=True)
                raise
        self._take_tokens(out, batch, pending.result(), committed=committed)
        if not self.scheduler.has_unfinished():
            self._drain()

    def _schedule(self, *, ahead: bool = False) -> tuple[SchedulerOutput, StepBatch]:
        """The scheduler's next step and its batch; ``ahead``: one scheduled before the last step's tokens are read."""
        out = self.scheduler.schedule()
        if out.is_empty and not ahead:
            waiting, running = self.scheduler.waiting, self.scheduler.running
            raise EngineError(  # the first few of each: under load the queues hold thousands
                f"a step scheduled nothing while requests wait (waiting: {len(waiting)}, first {waiting[:3]}; "
                f"running: {len(running)}, first {running[:3]}); please report this"
            )
        now = time.time()
        for seq in out.seqs:
            metrics = self._live[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        return out, out.batch(self.runner.block_size)

    def _launch_ahead(self, committed: SchedulerOutput, pending: PendingStep) -> None:
        """Schedule and launch the step after ``committed`` (advanced, its tokens not read), fed from ``pending``."""
        out, batch = self._schedule(ahead=True)
        if out.is_empty:  # nothing to run ahead (the synchronous path raises if nothing can run at all)
            return
        positions, rows = feed_rows(committed, out)
        feed = pending.feed(positions, rows) if positions else None
        self._ahead = (out, batch, self.runner.launch(batch, feed))

    def _drain(self) -> None:
        """Read and drop the step launched ahead, if any (its requests all ended since): nothing stays in flight."""
        if self._ahead is not None:
            out, batch, pending = self._ahead
            self._ahead = None
            self._take_tokens(out, batch, pending.result())

    def _take_tokens(
        self, out: SchedulerOutput, batch: StepBatch, sampled: list[Any], *, committed: bool = False
    ) -> None:
        """Give the step's tokens to its requests (``committed``: the scheduler advanced them already) and queue
        each live request's delta for its call."""
        now = time.time()
        self._record_logprobs(out, batch, sampled)
        for seq in self.scheduler.update(out, sampled, committed=committed):
            r = self._live[seq.request_id]
            r.call.outputs.append(self._advance(r))
            metrics = r.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            if seq.is_finished:
                r.call.unfinished -= 1
                metrics.finished_time = now

    def _record_logprobs(self, out: SchedulerOutput, batch: StepBatch, sampled: Any) -> None:
        """Keep the logprobs the step computed (``StepResult``) on the requests that asked for them."""
        rows = getattr(sampled, "logprobs", None)
        prompts = getattr(sampled, "prompt_logprobs", None)
        if not rows and not prompts:
            return
        drawing = _row_samples(out, batch)
        for row, found in (rows or {}).items():
            r = self._live.get(drawing[row].request_id)
            if r is not None and not r.seq.is_finished and isinstance(sampled[row], int):  # not a TokenError
                r.logprobs.append(self._as_logprobs(found))
        for index, positions in (prompts or {}).items():
            r = self._live.get(out.seqs[index].request_id)
            if r is not None:
                for position, found in positions:  # a recomputed prompt (after a preemption) rewrites the same values
                    r.prompt_logprobs[position] = self._as_logprobs(found)

    def _as_logprobs(self, found: TopLogprobs) -> dict[int, Logprob]:
        """One position's logprobs as vLLM gives them: the chosen token's first, then the top ones (ranks 1, 2...)."""
        decode = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else None
        entries = {found.token_id: Logprob(found.logprob, found.rank, decode(found.token_id) if decode else None)}
        for rank, (token, logprob) in enumerate(found.top, start=1):
            if token not in entries:
                entries[token] = Logprob(logprob, rank, decode(token) if decode else None)
        return entries

    def _advance(self, r: _Submission) -> StreamOutput:
        seq = r.seq
        if seq.finish_reason == "error":  # the step produced no token for it (TokenError): say why
            text = r.detokenizer.flush() if r.detokenizer is not None else ""
            r.text.append(text)
            seq.error = f"request {r.index}: {seq.error}"
            return r.delta([], text)
        token = seq.token_ids[-1]
        text = ""
        if r.detokenizer is not None:  # fed the token by the scheduler, which also decided on the stop strings
            text = r.detokenizer.take()
            if seq.is_finished:
                text += r.detokenizer.flush()
        r.text.append(text)
        delta = r.delta([token], text, r.logprobs[-1:] if seq.params.logprobs is not None else None)
        if seq.is_finished:
            delta.stop_reason = self._stop_reason(r)
            if seq.sample_index == 0 and seq.params.prompt_logprobs is not None:
                delta.prompt_logprobs = r.prompt_logprobs or None
        return delta

    def _output(self, samples: list[_Submission]) -> RequestOutput:
        """One request's output from its samples (in sample order)."""
        first = samples[0]
        completions = [
            CompletionOutput(
                r.seq.sample_index,
                "".join(r.text),
                r.seq.output_token_ids,
                r.seq.finish_reason,
                r.seq.error,
                self._stop_reason(r),
                *_sample_logprobs(r),
            )
            for r in samples
        ]
        preemptions = sum(r.seq.num_preemptions for r in samples)
        seq = first.seq
        return RequestOutput(
            first.request_id,
            first.prompt,
            seq.prompt_token_ids,
            completions,
            True,
            preemptions,
            first.metrics,
            seq.num_cached_tokens,
            first.prompt_logprobs or None if seq.params.prompt_logprobs is not None else None,
        )

    def _stop_reason(self, r: _Submission) -> int | str | None:
        """The stop token id or stop string that ended a sample; ``None`` for end-of-sequence and every other end."""
        seq = r.seq
        if seq.finish_reason != "stop" or not seq.output_token_ids:
            return None
        last = seq.output_token_ids[-1]
        if last in seq.stop_token_ids:  # the scheduler checks stop tokens before stop strings
            end_of_sequence = not seq.params.ignore_eos and last in self.config.eos_token_ids
            return None if end_of_sequence else last
        return r.detokenizer.matched if r.detokenizer is not None else None

    def close(self) -> None:
        """Give the KV cache's memory back now, even while this object is still referenced; it runs no request
        afterwards (``RuntimeError``). The weights go with the last reference to it."""
        self._finalizer()
        self._empty_caches()

    def _empty_caches(self) -> None:
        """Give what the allocators of the engine's platforms hold cached but unused back to the devices.

        A caching allocator counts those blocks as free, but it can give one back to the device only once all
        of it is unused. On an H100 the fourth engine of one process could not allocate its 48 GiB KV cache
        while 62 GiB counted as free, most of it cached for the three engines before it; alone in a new
        process the same engine could. Not with tensor or pipeline ranks, which own the devices: asking a GPU's
        allocator here would open a device context in this process.
        """
        if self.engine_config.ranks != 1:
            return
        platforms = self.placement.platforms if self.placement is not None else None
        for runtime in [self.runtime] if platforms is None else [platforms[name] for name in platforms]:
            runtime.allocator().empty_cache()

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError(
                "LLM.close() was called: its KV cache was given back, so it runs no more requests; create a new LLM"
            )

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_samples(out: SchedulerOutput, batch: StepBatch) -> list[Request]:
    """The sample each sampling row of ``batch`` draws for: a sequence's own row, then one row per sample
    waiting to fork from it (``SchedulerOutput.batch`` lays them out so)."""
    drawing: list[Request] = []
    previous, k = -1, 0
    for i in batch.sample_rows:
        k = k + 1 if i == previous else 0
        previous = i
        seq = out.seqs[i]
        drawing.append((seq, *seq.forks)[k])
    return drawing


def _sample_logprobs(r: _Submission) -> tuple[list[dict[int, Logprob]] | None, float | None]:
    """A sample's ``CompletionOutput.logprobs`` and ``cumulative_logprob`` (``None`` unless its request asked)."""
    if r.seq.params.logprobs is None:
        return None, None
    drawn = zip(r.logprobs, r.seq.output_token_ids, strict=False)
    return r.logprobs, sum(entries[token].logprob for entries, token in drawn)


@contextmanager
def _interrupt_after_step() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives during a step until the step is done, then raise ``KeyboardInterrupt``.

    A step stopped half-way could leave blocks taken by no sequence; a finished one leaves the books
    whole, and ``_run``'s cleanup then aborts every unfinished request, so the KV pool and swap
    space are all free when ``generate`` raises. A second SIGINT in the same step interrupts at once.
    Only in the main thread (where Python delivers SIGINT) with Python's own handler installed: a
    handler of the caller's is left alone.
    """
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt


def _token_ids_problem(params: SamplingParams, vocab: int) -> str | None:
    """What is wrong with the token ids a request's ``logit_bias`` and ``allowed_token_ids`` name (``None``: nothing)."""
    for name, ids in (("logit_bias", params.logit_bias or {}), ("allowed_token_ids", params.allowed_token_ids or [])):
        outside = sorted({t for t in ids if t >= vocab})
        if outside:
            return f"SamplingParams.{name} names token id(s) {outside[:5]} outside the model's vocabulary [0, {vocab})"
    return None


def _bad_words_token_ids(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """Each bad word's token ids, as written and after a space (mid-sentence), as vLLM bans them."""
    found: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in found:
                found.append(ids)
    return found


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


#: Binary prompts: refused per request (they are sequences of ints, but bytes of text, not token ids).
_BYTES = (bytes, bytearray, memoryview)


def _unicode_problem(text: str) -> str | None:
    """What makes ``text`` invalid Unicode (a lone surrogate, which no tokenizer encodes), or ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"the prompt is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}; "
            "fix the text where it was decoded (errors='replace' drops such characters) or pass token ids"
        )
    return None


def _prompt_index(r: _Submission) -> int:
    return r.index


def _sample_id(request_id: str, sample_index: int) -> str:
    """The scheduler's id of a request's sample: the request's own for the first, ``"<id>#<i>"`` for the others."""
    return request_id if sample_index == 0 else f"{request_id}#{sample_index}"


class _Progress:
    """A ``generate`` call's progress bar: prompts done of prompts given, with output tokens per second.

    Made only when asked for (``use_tqdm``) and, with ``tqdm`` itself, only when stderr is a terminal
    (``disable=None``); a bar of the caller's (a callable) is made as the caller asks.
    """

    def __init__(self, requests: list[_Submission], use_tqdm: bool | Callable[..., Any]) -> None:
        self._left: dict[int, int] = {}  # prompt index -> samples not finished
        for r in requests:
            self._left[r.index] = self._left.get(r.index, 0) + 1
        self._tokens = 0
        self._bar: Any = None
        if use_tqdm and self._left:
            from tqdm import tqdm

            make = use_tqdm if callable(use_tqdm) else tqdm
            options = {} if callable(use_tqdm) else {"disable": None, "dynamic_ncols": True}
            self._bar = make(total=len(self._left), desc="Processed prompts", unit="prompt", **options)
            if getattr(self._bar, "disable", False):  # tqdm's own, off: stderr is not a terminal
                self._bar.close()
                self._bar = None

    def update(self, delta: StreamOutput) -> None:
        if self._bar is None:
            return
        self._tokens += len(delta.token_ids)
        if delta.finish_reason is None:
            return
        self._left[delta.index] -= 1
        if self._left[delta.index] == 0:
            elapsed = self._bar.format_dict.get("elapsed", 0) if hasattr(self._bar, "format_dict") else 0
            if elapsed:
                self._bar.set_postfix_str(f"output {self._tokens / elapsed:.1f} tok/s", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict, *_BYTES)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(_is_token_id(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise ValueError(f"prompts is {prompts!r:.80}; give text, a list of token ids, or a list of those")


def _as_params_list(params: Any, n: int, default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    listed = list(params)
    if len(listed) != n or not all(isinstance(p, SamplingParams) for p in listed):
        raise ValueError(
            f"sampling_params: give one SamplingParams or a list of {n} (one per prompt), got {params!r:.80}"
        )
    return listed


def _resolve_dtype(dtype: str | torch.dtype, checkpoint: torch.dtype) -> torch.dtype:
    if dtype == "auto":
        return checkpoint if checkpoint in FLOAT_DTYPES else torch.float32
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if resolved not in FLOAT_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in FLOAT_DTYPES))
        raise ValueError(f"dtype {dtype!r} is not one the ops run; use 'auto' or one of {names}")
    return resolved  # type: ignore[return-value]


#: The default KV-cache budget on a host platform (``device_type`` ``"cpu"``): the cache shares host
#: memory with the weights, the OS and every other process, so it takes a bounded share, as vLLM's
#: CPU build does (its default KV space is 4 GiB too). ``LLM(kv_cache_memory=...)`` overrides it.
HOST_KV_CACHE_BYTES = 4 << 30
#: The share of free memory the KV cache takes by default.
DEFAULT_KV_FRACTION = 0.8


def _default_kv_budget(runtime: Runtime) -> float | int:
    """The KV budget when the user gives none: a share of the device, bounded bytes on a host platform."""
    if runtime.platform.device_type != "cpu":
        return DEFAULT_KV_FRACTION
    free, _ = runtime.allocator().mem_info()
    return max(1, min(HOST_KV_CACHE_BYTES, int(free * DEFAULT_KV_FRACTION)))


def _rope_positions(
    runtime: Runtime,
    config: Any,
    dtype: torch.dtype,
    longest: int,
    kv_cache_memory: float | int,
    ranks: int = 1,
    stages: int = 1,
) -> int:
    """Positions the rotary table needs: ``longest``, or fewer when the budget cannot cache that many tokens.

    The budget's bytes are bounded before the weights load (a fraction of the memory free now is at
    least that of the memory free after), so the context the cache ends up holding never outgrows the table.
    With ``ranks`` tensor-parallel ranks each rank's cache holds its share of the KV heads; with ``stages``
    pipeline stages each holds its layers' (the smallest stage's count bounds what any cache holds).
    """
    budget = kv_cache_memory
    if isinstance(budget, float):
        budget = int(runtime.allocator().mem_info()[0] * budget)
    kv_heads = max(1, config.num_kv_heads // ranks)
    layers = max(1, config.num_layers // stages)
    token_bytes = 2 * layers * kv_heads * config.head_size * dtype.itemsize
    return max(2, min(longest, budget // token_bytes))


def _default_swap(runtime: Runtime, kv_cache_memory: float | int) -> int:
    """Swap space by default: as much as an int KV budget (else 4 GiB) on platforms with a pinned host tier."""
    if "pinned_host" not in runtime.platform.memory_tiers:
        return 0
    return min(kv_cache_memory, 4 << 30) if isinstance(kv_cache_memory, int) else 4 << 30


def _load_platforms(config: EngineConfig) -> tuple[Runtime, Any]:
    """The engine's runtime, and its placement over several platforms when ``config`` places the model (else ``None``).

    The placement is a ``vllm_port.placement.EnginePlacement``; its first platform is the engine's.
    """
    if config.places:
        from ..placement import EnginePlacement

        placement = EnginePlacement.create(config.placement, config.devices, config.device, config.plugins)
        return placement.platforms.default, placement
    if isinstance(config.device, Runtime):
        return config.device, None
    return load(config.plugins, None if config.device == "auto" else config.device), None


@dataclass(frozen=True)
class _OpenedModel:
    """The model an engine runs, opened but not loaded.

    Attributes:
        model_dir: the directory the model comes from; ``None`` for a ``transformers`` module.
        imported: the model imported from ``transformers`` (``vllm_port.importer``), or ``None``:
            the core model definitions load ``model_dir``.
        config: the model's config (``vllm_port.models.ModelConfig``).
        dtype: the dtype it runs in.
        tokenizer: the directory's ``tokenizer.json``; ``None`` without one.
    """

    model_dir: Path | None
    imported: Any
    config: Any
    dtype: torch.dtype
    tokenizer: Tokenizer | None

    @property
    def weights(self) -> Any:
        """What the runner loads: the imported model, or the model directory."""
        return self.imported if self.imported is not None else self.model_dir


def _open_model(config: EngineConfig, runtime: Runtime) -> _OpenedModel:
    """``config.model``'s config, dtype, weights source and tokenizer, checked before any weight loads.

    An imported model is imported here (``vllm_port.importer``: ``config.importer``, or a ``transformers``
    module); a directory's config is checked against the memory free for its weights.
    """
    imported, model = None, config.model
    if config.imports:
        from ..importer.engine import import_for_engine

        imported = import_for_engine(
            model, config.importer, runtime, config.dtype, _resolve_dtype, config.tensor_parallel_size
        )
        model_dir = Path(model) if isinstance(model, (str, os.PathLike)) else None
        model_config, dtype = imported.config, imported.dtype
    else:
        model_dir = bundled_model_dir() if model is None else Path(model)
        model_config = load_config(model_dir)
        dtype = _resolve_dtype(config.dtype, model_config.dtype)
        _check_fits(config, runtime, model_config, dtype, model_dir)
    if config.max_model_len is not None and config.max_model_len > model_config.max_position_embeddings:
        source = model_dir / "config.json" if model_dir else model_config.architecture
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
            f"({model_config.max_position_embeddings}, {source}); lower it"
        )
    # an imported module brings no tokenizer of its own: prompts are token ids unless tokenizer= names one
    tokenizer = open_tokenizer(model_dir, config.tokenizer)
    return _OpenedModel(model_dir, imported, model_config, dtype, tokenizer)


def _check_fits(config: EngineConfig, runtime: Runtime, model_config: Any, dtype: torch.dtype, model_dir: Path) -> None:
    """Refuse weights the memory cannot hold, from config.json's sizes alone (before anything is allocated).

    With tensor parallelism the ranks own the devices (asking here could open a device context in
    this process), and a placement checks each platform's share: then only host memory is checked.
    """
    one_device = config.ranks == 1 and not config.places
    check_fits(
        model_config,
        dtype,
        device_free=runtime.allocator().mem_info()[0] if one_device else None,
        host_free=host_memory()[0],
        where=f"platform {runtime.platform.name!r}'s device",
        config_path=model_dir / "config.json",
    )


@dataclass(frozen=True)
class _CacheSizing:
    """The KV cache an engine asks its runner for (``ModelRunner``'s arguments of the same names).

    Attributes:
        max_positions: positions of the rotary table: the longest context the cache could hold, not
            the config's maximum; ``None`` for an imported model, which builds its own.
    """

    block_size: int
    kv_cache_memory: float | int
    swap_space: int
    max_tokens: int
    max_positions: int | None

    def runner_arguments(self) -> dict[str, Any]:
        sizes = {name: getattr(self, name) for name in ("block_size", "kv_cache_memory", "swap_space", "max_tokens")}
        return sizes if self.max_positions is None else {**sizes, "max_positions": self.max_positions}


def _size_cache(config: EngineConfig, runtime: Runtime, model: _OpenedModel, placement: Any) -> _CacheSizing:
    """The cache ``config`` asks for, with the platform's defaults where it gives none."""
    block_size = runtime.platform.kv_block_size if config.block_size is None else config.block_size
    longest = config.max_model_len or model.config.max_position_embeddings
    budget = _default_kv_budget(runtime) if config.kv_cache_memory is None else config.kv_cache_memory
    if config.gpu_memory_utilization is not None:
        budget = _utilization_budget(config, runtime, model)
    swap_space = config.swap_space
    if swap_space is None:
        swap_space = 0 if placement is not None else _default_swap(runtime, budget)
    positions = None
    if model.imported is None:
        ranks, stages = config.tensor_parallel_size, config.pipeline_parallel_size
        positions = _rope_positions(runtime, model.config, model.dtype, longest, budget, ranks, stages)
    # whole blocks per sequence: 8 sequences of 48 tokens need 8 blocks of 128, not 3
    max_tokens = config.max_num_seqs * -(-longest // block_size) * block_size
    return _CacheSizing(block_size, budget, swap_space, max_tokens, positions)


def _utilization_budget(config: EngineConfig, runtime: Runtime, model: _OpenedModel) -> int:
    """The KV budget ``gpu_memory_utilization`` leaves: of the device's (a host platform's: the host's) total
    memory, that share less the weights (per rank) and the activations' peak."""
    free, total = runtime.allocator().mem_info()
    itemsize = model.dtype.itemsize
    if model.imported is None:  # not loaded yet: the bytes config.json's sizes say, per rank
        weights = -(-model.config.weight_bytes(model.dtype) // config.ranks)
    else:  # imported, so loaded already: its tensors' bytes, which the free memory no longer counts
        weights = _module_bytes(model.imported)
        free += weights
    # a captured step holds the logits of every row it replays (up to captured_rows)
    captures = runtime.platform.graph_capture and not (config.enforce_eager or config.places)
    rows = config.captured_rows if captures else config.max_num_seqs
    activations = activation_peak_bytes(model.config, itemsize, config.max_num_batched_tokens, rows)
    host = runtime.platform.device_type == "cpu"
    where = "host memory" if host else f"platform {runtime.platform.name!r}'s device"
    return memory_utilization_budget(config.gpu_memory_utilization, free, total, weights, activations, where)


def _module_bytes(model: Any) -> int:
    """Bytes of the parameters and buffers of every ``torch.nn.Module`` an imported model holds (shared ones once)."""
    parts = [*getattr(model, "layers", []), *(getattr(model, n, None) for n in ("embed", "norm", "lm_head"))]
    seen: dict[int, int] = {}
    for part in parts:
        if isinstance(part, torch.nn.Module):
            for t in itertools.chain(part.parameters(), part.buffers()):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _make_scheduler(config: EngineConfig, runtime: Runtime, runner: Any, max_model_len: int) -> Scheduler:
    """The scheduler over the runner's block pools, asking the platform's reclaimer when they run short."""
    return Scheduler(
        SchedulerConfig(
            max_model_len, config.max_num_seqs, config.max_num_batched_tokens, config.enable_prefix_caching
        ),
        runner.pool,
        runtime.reclaimer(),
        runner.swap_pool,
        reclaimer_name=f"plugin {runtime.reclaimer_plugin!r}'s reclaimer",
    )


def _refuse_fp8_beyond_one_device(config: EngineConfig, model: _OpenedModel) -> None:
    """FP8 checkpoints run on one platform: their scales are not sharded over ranks nor placed beside their weights."""
    if getattr(model.config, "quantization", None) is None:
        return
    if config.tensor_parallel_size != 1:
        mode = "tensor_parallel_size > 1 would split the projections from their scales"
    elif config.pipeline_parallel_size != 1:
        mode = "pipeline_parallel_size > 1 is not tested with FP8 checkpoints"
    else:
        mode = "placement/devices would split the projections from their scales"
    if config.ranks != 1 or config.places:
        raise ModelLoadError(
            f"{model.model_dir}: config.json's quantization_config makes an FP8 checkpoint, which runs on one device "
            f"so far ({mode}); use tensor_parallel_size=1, pipeline_parallel_size=1 and no placement"
        )


def _make_runner(
    config: EngineConfig, runtime: Runtime, model: _OpenedModel, placement: Any, sizing: _CacheSizing
) -> Any:
    """The runner of ``config``'s mode: a ``ModelRunner`` in this process (plain, imported or placed), or
    a ``TensorParallelRunner`` over ``tensor_parallel_size`` worker ranks, a ``PipelineParallelRunner`` over
    ``pipeline_parallel_size`` stages, or this process as one rank a launcher
    started (``LaunchedRankRunner``)."""
    _refuse_fp8_beyond_one_device(config, model)
    if config.launched:
        from .external_launcher import LaunchedRankRunner

        return LaunchedRankRunner(
            runtime,
            model.weights,
            model.dtype,
            config.ranks,
            pipeline=config.pipeline_parallel_size != 1,
            kv_cache_dtype=config.kv_cache_dtype,
            **sizing.runner_arguments(),
        )
    if config.pipeline_parallel_size != 1:
        from .pipeline_parallel import PipelineParallelRunner

        return PipelineParallelRunner(
            runtime,
            model.weights,
            model.dtype,
            config.pipeline_parallel_size,
            kv_cache_dtype=config.kv_cache_dtype,
            **sizing.runner_arguments(),
        )
    if config.tensor_parallel_size == 1:
        return ModelRunner(
            runtime,
            model.weights,
            model.dtype,
            make_step=config.make_step,
            placement=placement,
            kv_cache_dtype=config.kv_cache_dtype,
            **sizing.runner_arguments(),
        )
    from .tensor_parallel import TensorParallelRunner

    return TensorParallelRunner(
        runtime,
        model.weights,
        model.dtype,
        config.tensor_parallel_size,
        kv_cache_dtype=config.kv_cache_dtype,
        **sizing.runner_arguments(),
    )


def _sampling_defaults(source: str, model_dir: Path | None) -> dict[str, Any]:
    """The sampling defaults ``generation_config`` names (see ``LLM``), checked as ``SamplingParams`` checks a request.

    :raises ModelLoadError: naming the file when a default is out of ``SamplingParams``' range.
    """
    if source == "vllm" or (source == "auto" and model_dir is None):
        return {}
    folder = Path(model_dir if source == "auto" else source)  # type: ignore[arg-type]
    defaults = read_sampling_defaults(folder)
    try:
        SamplingParams(**defaults).validate()
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(
            f"{folder / 'generation_config.json'}: a sampling default is out of range: {exc}; fix the file, or "
            "give LLM(generation_config='vllm') (--generation-config vllm) to ignore it"
        ) from None
    return defaults
