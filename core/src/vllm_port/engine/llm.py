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
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import bundled_model_dir
from ..errors import VllmPortError
from ..memory import host_memory
from ..models import load_config
from ..models.config import model_file
from ..models.loader import check_fits
from ..ops import FLOAT_DTYPES
from ..runtime import Runtime, load
from .request import Request
from .runner import ModelRunner, StepFunction
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .tokenizer import TOKENIZER_FILE, IncrementalDetokenizer, Tokenizer

__all__ = ["HOST_KV_CACHE_BYTES", "LLM", "CompletionOutput", "EngineError", "RequestOutput", "StreamOutput"]

#: A prompt: text (needs the model's tokenizer.json) or token ids.
Prompt = str | Sequence[int]


class EngineError(VllmPortError):
    """The engine cannot go on (a step scheduled nothing while requests wait); a bug, reported with the state."""


@dataclass
class CompletionOutput:
    """What a request generated.

    Attributes:
        index: the request's position in the ``generate`` call.
        text: the generated text (empty without a tokenizer), cut before a stop string.
        token_ids: the generated token ids (a stop token, or the token completing a stop string, included).
        finish_reason: ``"stop"``, ``"length"``, ``"error"`` or ``"abort"``.
        error: what was wrong with the request, when ``finish_reason == "error"``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None


@dataclass
class RequestOutput:
    """One request's prompt and its (single) completion, as vLLM's ``RequestOutput``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_preemptions: int = 0


@dataclass
class StreamOutput:
    """New tokens of one request, as ``stream`` yields them; ``finish_reason`` is set on the request's last one."""

    index: int
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
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
    index: int
    prompt: str | None
    seq: Request  # finish_reason "error": refused before scheduling
    detokenizer: IncrementalDetokenizer | None
    text: list[str] = field(default_factory=list)
    call: _Call | None = None  # the call that yields this request's deltas, once it runs


class LLM:
    """A model loaded on the selected hardware, with a scheduler and a paged KV cache, ready to generate.

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
    :param enforce_eager: never replay captured graphs. By default decode steps are captured as
        device graphs per batch size on platforms that offer graph capture (the CUDA plugin does;
        the CPU plugin does not, and there every step runs as it is).
    :param placement: a placement policy (a ``.toml``/``.json`` file, a mapping or a
        :class:`~vllm_port.placement.PlacementPolicy`): the model's nodes on several platforms,
        run eagerly, without swap space by default (``docs/placement.md``).
    :param devices: the platforms to load for ``placement`` (the first holds the batch and samples);
        default: ``device`` and every platform the policy names.
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
    ) -> None:
        # the cheap argument checks first: importing moves, casts and traces the user's module
        importing = importer is not None or isinstance(model, torch.nn.Module)
        if importing and (placement is not None or devices is not None):
            raise ValueError(
                "placement of imported models is not supported yet: an imported model (importer= or a transformers "
                "module) runs on one platform; drop placement/devices, or place the core model definitions "
                "(importer=None)"
            )
        _check_engine_args(
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            swap_space=swap_space,
            seed=seed,
            plugins=plugins,
            enforce_eager=enforce_eager,
        )
        self.placement = _placement(placement, devices, device, plugins, tensor_parallel_size)  # None: one platform
        if self.placement is not None:
            self.runtime = self.placement.platforms.default
        else:
            self.runtime = (
                device if isinstance(device, Runtime) else load(plugins, None if device == "auto" else device)
            )
        block_size = self.runtime.platform.kv_block_size if block_size is None else block_size
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size is {block_size!r}; it must be a positive int (tokens per KV-cache block)")
        imported = None  # a transformers module, or a directory loaded through transformers (vllm_port.importer)
        if importing:
            from ..importer.engine import import_for_engine

            imported = import_for_engine(model, importer, self.runtime, dtype, _resolve_dtype, tensor_parallel_size)
            model = model if isinstance(model, (str, os.PathLike)) else None
        self.model_dir = Path(model) if model is not None else None if imported is not None else bundled_model_dir()
        config = imported.config if imported is not None else load_config(self.model_dir)
        self.dtype = imported.dtype if imported is not None else _resolve_dtype(dtype, config.dtype)
        # from config.json's sizes alone, before any weight or cache is allocated; with tensor
        # parallelism the ranks own the devices (asking here could open a device context in this process)
        if imported is None:
            check_fits(
                config,
                self.dtype,
                device_free=self.runtime.allocator().mem_info()[0]
                if tensor_parallel_size == 1 and not self.placement  # placement checks each platform's share
                else None,
                host_free=host_memory()[0],
                where=f"platform {self.runtime.platform.name!r}'s device",
                config_path=self.model_dir / "config.json",
            )
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            source = self.model_dir / "config.json" if self.model_dir else config.architecture
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"({config.max_position_embeddings}, {source}); lower it"
            )
        self.tokenizer = None  # an imported module brings no tokenizer: prompts are token ids
        if self.model_dir is not None:
            model_file(self.model_dir, TOKENIZER_FILE)  # refuses a tokenizer.json linking out of the directory
            self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        longest = max_model_len or config.max_position_embeddings
        kv_cache_memory = _default_kv_budget(self.runtime) if kv_cache_memory is None else kv_cache_memory
        # the rotary table covers the longest context the cache could hold, not the config's maximum
        rope = (
            {}
            if imported is not None
            else {
                "max_positions": _rope_positions(
                    self.runtime, config, self.dtype, longest, kv_cache_memory, tensor_parallel_size
                )
            }
        )
        if swap_space is None:
            swap_space = 0 if self.placement else _default_swap(self.runtime, kv_cache_memory)
        self.runner = _make_runner(
            self.runtime,
            self.model_dir if imported is None else imported,
            self.dtype,
            tensor_parallel_size,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            swap_space=swap_space,
            # whole blocks per sequence: 8 sequences of 48 tokens need 8 blocks of 128, not 3
            max_tokens=max_num_seqs * -(-longest // block_size) * block_size,
            **({"make_step": make_step} if make_step is not None else {}),
            **({"placement": self.placement} if self.placement is not None else {}),
            **rope,
        )
        # the cache's memory goes back to the allocator when the LLM goes away, closed or not
        self._finalizer = weakref.finalize(self, self.runner.close)
        self.config = config
        capacity = self.runner.pool.num_blocks * block_size
        self.max_model_len = max_model_len or min(config.max_position_embeddings, capacity, *rope.values())
        try:
            self.scheduler = Scheduler(
                SchedulerConfig(self.max_model_len, max_num_seqs, max_num_batched_tokens, enable_prefix_caching),
                self.runner.pool,
                self.runtime.reclaimer(),
                self.runner.swap_pool,
                reclaimer_name=f"plugin {self.runtime.reclaimer_plugin!r}'s reclaimer",
            )
            #: the decode batch sizes replayed from captured graphs (empty: every step eager)
            self.captured_batch_sizes = (
                [] if enforce_eager or self.placement else self.runner.capture_decode(max_num_seqs, self.max_model_len)
            )
        except BaseException:
            self.close()
            raise
        self._seeds = random.Random(seed)  # noqa: S311 - sampling seeds, not secrets
        self._ids = itertools.count()
        self._live: dict[str, _Submission] = {}  # requests of open generate/stream calls, by id

    # --- facts -------------------------------------------------------------------------------------

    @property
    def platform(self) -> str:
        """The selected platform's name."""
        return self.runtime.platform.name

    @property
    def provider_per_op(self) -> dict[str, str]:
        """The provider bound to each op for the model's dtype."""
        return dict(self.runner.provider_per_op)

    # --- generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the prompts' order.

        :param prompts: a prompt or a list of them; a prompt is text or a list of token ids.
        :param sampling_params: one for all prompts, or one per prompt (default ``SamplingParams()``).
        :raises ValueError: for sampling parameters no request can run with, before anything runs.
        :raises KeyboardInterrupt: on Ctrl-C, once the step under way is done and every request's
            blocks are back in the pool (and swap space).
        """
        requests = self._requests(prompts, sampling_params)
        for _ in self._run(requests):
            pass
        return [self._output(r) for r in requests]

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

    # --- internals ---------------------------------------------------------------------------------

    def _requests(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[_Submission]:
        listed = _as_prompt_list(prompts)
        per_prompt = _as_params_list(params, len(listed))
        for p in per_prompt:
            p.validate()
            if p.stop_strings and self.tokenizer is None:
                raise ValueError(
                    f"SamplingParams.stop {list(p.stop_strings)}: stop strings need the model's tokenizer, and "
                    f"{self.model_dir} has no tokenizer.json; use stop_token_ids"
                )
        requests = []
        for index, (prompt, p) in enumerate(zip(listed, per_prompt, strict=True)):
            request_id = str(next(self._ids))
            text = prompt if isinstance(prompt, str) else None
            ids, problem = self._prompt_ids(prompt)
            if problem is not None:
                seq = Request(request_id, -1, ids, p)
                seq.finish_reason, seq.error = "error", f"request {index}: {problem}"
                requests.append(_Submission(index, text, seq, None))
                continue
            stop_ids = [*(p.stop_token_ids or []), *([] if p.ignore_eos else self.config.eos_token_ids)]
            seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
            # the scheduler feeds the detokenizer each token, and stops the request on a stop string it finds
            detok = IncrementalDetokenizer(self.tokenizer, ids, p.stop_strings) if self.tokenizer else None
            seq = Request(request_id, int(request_id), ids, p, stop_ids, seed, stop_matcher=detok)
            requests.append(_Submission(index, text, seq, detok))
        return requests

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
        mine = [r for r in requests if r.seq.finish_reason != "error"]
        for r in requests:
            if r.seq.finish_reason == "error":
                call.outputs.append(StreamOutput(r.index, r.seq.request_id, [], "", "error", r.seq.error))
        for r in mine:
            r.call = call
            self._live[r.seq.request_id] = r
            self.scheduler.add(r.seq)
        call.unfinished = len(mine)
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

    def abort(self, request_id: str) -> bool:
        """End a running request now: its blocks go back to the pool (its cached prefix stays cached).

        ``request_id`` is a :class:`StreamOutput`'s ``request_id``. Call it from the thread that
        consumes the stream, between deltas; the stream then yields the request's last output,
        with ``finish_reason == "abort"``, and goes on with the others (``generate`` reports the
        request as aborted with the tokens it had).

        :return: whether the request was running (``False``: unknown, or already finished).
        """
        r = self._live.get(request_id)
        if r is None or r.seq.is_finished or r.call is None:
            return False
        self.scheduler.finish(r.seq, "abort")
        text = r.detokenizer.flush() if r.detokenizer is not None else ""
        r.text.append(text)
        r.call.outputs.append(StreamOutput(r.index, request_id, [], text, "abort"))
        r.call.unfinished -= 1
        return True

    def _step(self) -> None:
        """One engine step: schedule, run, and queue each live request's new token for its call."""
        out = self.scheduler.schedule()
        if out.is_empty:
            waiting, running = self.scheduler.waiting, self.scheduler.running
            raise EngineError(  # the first few of each: under load the queues hold thousands
                f"a step scheduled nothing while requests wait (waiting: {len(waiting)}, first {waiting[:3]}; "
                f"running: {len(running)}, first {running[:3]}); please report this"
            )
        sampled = self.runner.execute(out.batch(self.runner.block_size))
        for seq in self.scheduler.update(out, sampled):
            r = self._live[seq.request_id]
            r.call.outputs.append(self._advance(r))
            if seq.is_finished:
                r.call.unfinished -= 1

    def _advance(self, r: _Submission) -> StreamOutput:
        seq = r.seq
        if seq.finish_reason == "error":  # the step produced no token for it (TokenError): say why
            text = r.detokenizer.flush() if r.detokenizer is not None else ""
            r.text.append(text)
            seq.error = f"request {r.index}: {seq.error}"
            return StreamOutput(r.index, seq.request_id, [], text, "error", seq.error)
        token = seq.token_ids[-1]
        text = ""
        if r.detokenizer is not None:  # fed the token by the scheduler, which also decided on the stop strings
            text = r.detokenizer.take()
            if seq.is_finished:
                text += r.detokenizer.flush()
        r.text.append(text)
        return StreamOutput(r.index, seq.request_id, [token], text, seq.finish_reason, seq.error)

    def _output(self, r: _Submission) -> RequestOutput:
        seq = r.seq
        completion = CompletionOutput(r.index, "".join(r.text), seq.output_token_ids, seq.finish_reason, seq.error)
        return RequestOutput(seq.request_id, r.prompt, seq.prompt_token_ids, [completion], True, seq.num_preemptions)

    def close(self) -> None:
        """Give the KV cache's memory back (the object is unusable afterwards)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _check_engine_args(**args: Any) -> None:
    """Refuse an ``LLM`` argument of the wrong type or range, by its own name, before anything is loaded."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    rules: dict[str, tuple[Callable[[Any], bool], str]] = {
        "tensor_parallel_size": (lambda v: is_int(v) and v >= 1, "an int >= 1 (devices to shard the model over)"),
        "max_model_len": (lambda v: v is None or (is_int(v) and v >= 2), "None or an int >= 2 (prompt and output)"),
        "kv_cache_memory": (
            lambda v: v is None or (is_int(v) and v >= 1) or (isinstance(v, float) and 0.0 < v <= 1.0),
            "None (the platform's default), a fraction in (0, 1] of the free device memory, or an int of bytes >= 1",
        ),
        "max_num_seqs": (lambda v: is_int(v) and v >= 1, "an int >= 1 (the most requests running at once)"),
        "max_num_batched_tokens": (lambda v: is_int(v) and v >= 1, "an int >= 1 (tokens one step may run)"),
        "swap_space": (lambda v: v is None or (is_int(v) and v >= 0), "None or an int of bytes >= 0 (0: no swap)"),
        "seed": (lambda v: v is None or is_int(v), "None or an int"),
        "plugins": (lambda v: v is None or isinstance(v, str), "None or an allow/deny list such as 'cpu' or '-rocm'"),
        "enable_prefix_caching": (lambda v: isinstance(v, bool), "True or False"),
        "enforce_eager": (lambda v: isinstance(v, bool), "True or False"),
    }
    for name, value in args.items():
        accepts, expected = rules[name]
        if not accepts(value):
            raise ValueError(f"LLM({name}={value!r:.80}): {name} is {value!r:.80}; it must be {expected}")


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, *_BYTES)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(_is_token_id(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, Sequence):
        return list(prompts)
    raise ValueError(f"prompts is {prompts!r:.80}; give text, a list of token ids, or a list of those")


def _as_params_list(params: Any, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
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
    runtime: Runtime, config: Any, dtype: torch.dtype, longest: int, kv_cache_memory: float | int, ranks: int = 1
) -> int:
    """Positions the rotary table needs: ``longest``, or fewer when the budget cannot cache that many tokens.

    The budget's bytes are bounded before the weights load (a fraction of the memory free now is at
    least that of the memory free after), so the context the cache ends up holding never outgrows the table.
    With ``ranks`` tensor-parallel ranks each rank's cache holds its share of the KV heads.
    """
    budget = kv_cache_memory
    if isinstance(budget, float):
        budget = int(runtime.allocator().mem_info()[0] * budget)
    kv_heads = max(1, config.num_kv_heads // ranks)
    token_bytes = 2 * config.num_layers * kv_heads * config.head_size * dtype.itemsize
    return max(2, min(longest, budget // token_bytes))


def _default_swap(runtime: Runtime, kv_cache_memory: float | int) -> int:
    """Swap space by default: as much as an int KV budget (else 4 GiB) on platforms with a pinned host tier."""
    if "pinned_host" not in runtime.platform.memory_tiers:
        return 0
    return min(kv_cache_memory, 4 << 30) if isinstance(kv_cache_memory, int) else 4 << 30


def _placement(placement: Any, devices: Sequence[str] | None, device: Any, plugins: str | None, tp: int) -> Any:
    """The engine's placement (``vllm_port.placement.EnginePlacement``) when ``placement`` or ``devices`` is given."""
    if placement is None and devices is None:
        return None
    if tp != 1:
        raise ValueError("placement runs the model in this process; use tensor_parallel_size=1 with placement")
    from ..placement import EnginePlacement

    return EnginePlacement.create(placement, devices, device, plugins)


def _make_runner(runtime: Runtime, model_dir: Any, dtype: torch.dtype, tensor_parallel_size: int, **kwargs: Any) -> Any:
    if tensor_parallel_size == 1:
        return ModelRunner(runtime, model_dir, dtype, **kwargs)
    if "make_step" in kwargs:
        raise ValueError("make_step runs in this process; with tensor_parallel_size > 1 the ranks run the eager step")
    from .tensor_parallel import TensorParallelRunner

    return TensorParallelRunner(runtime, model_dir, dtype, tensor_parallel_size, **kwargs)
