"""``vllm-port generate``: the engine from the command line, with progress on stderr.

One text prompt streams its completion to stdout as it is generated; several prompts print each
completion when all are done; ``--json`` prints one object. Exit status: 0 when every request
completed, 1 when a request was refused (its error is printed), 2 when the model or the device
could not be loaded, 130 on Ctrl-C (SIGINT): the step under way finishes, the other requests are
aborted (their blocks freed), one line on stderr says so, and the requests that had finished are
printed (``--json``: those alone, each with its prompt's ``index``, and ``"interrupted": true``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from ..cli_flags import add_device_flag, add_engine_flags, add_json_flag, add_model_dtype_flag, engine_kwargs
from ..errors import VllmPortError

__all__ = ["DEFAULT_PROMPT", "HELP", "INTERRUPTED", "add_arguments", "run"]

HELP = "generate text with the engine (default: the bundled model)"

#: What ``generate`` continues when given no prompt.
DEFAULT_PROMPT = "Once upon a time"
#: The exit status after Ctrl-C, as a shell reports a process ended by SIGINT (128 + 2).
INTERRUPTED = 130


class Progress:
    """Progress on stderr: a line rewritten in place on a terminal, a summary line otherwise.

    Quiet for the first ``delay_s`` seconds of a step, so short runs print only their summary.
    """

    def __init__(self, stream: TextIO | None = None, delay_s: float = 1.0, every_s: float = 0.25) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.delay_s, self.every_s = delay_s, every_s
        self.start = self.last = time.monotonic()
        self._shown = False

    def begin(self, what: str) -> None:
        self.start = self.last = time.monotonic()
        if self.live:
            self._write(f"{what}...")

    def update(self, text: str) -> None:
        now = time.monotonic()
        if self.live and now - self.start >= self.delay_s and now - self.last >= self.every_s:
            self.last = now
            self._write(text)

    def end(self, text: str) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self._shown = False
        self.stream.write(f"{text}\n")
        self.stream.flush()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def _write(self, text: str) -> None:
        self.stream.write(f"\r\033[K{text}")
        self.stream.flush()
        self._shown = True


def _token_ids(spec: str) -> list[int]:
    try:
        return [int(t) for t in spec.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-token-ids {spec!r}: write token ids as 1,2,3") from None


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port generate`` with parsed ``args``; return the exit status."""
    from .llm import LLM
    from .sampling_params import SamplingParams

    prompts: list[Any] = [*args.prompts, *(args.prompt_token_ids or [])] or [DEFAULT_PROMPT]
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    progress = Progress()
    progress.begin("loading the model")
    try:
        llm = LLM(
            args.model,
            device=args.device or "auto",
            dtype=args.dtype,
            **engine_kwargs(args),
        )
    except (VllmPortError, ValueError) as exc:
        progress.end(f"error: {exc}")
        return 2
    progress.end(
        f"loaded {llm.model_dir} on {llm.platform} ({str(llm.dtype).removeprefix('torch.')}) in {progress.elapsed:.1f} s"
    )
    echo = not args.json and len(prompts) == 1 and isinstance(prompts[0], str) and llm.tokenizer is not None
    outputs: list[dict[str, Any]] = [
        {"index": i, "token_ids": [], "text": "", "finish_reason": None} for i in range(len(prompts))
    ]
    try:
        _generate(llm, prompts, params, progress, echo, outputs)
    except KeyboardInterrupt:
        return _interrupted(llm, prompts, outputs, progress, args.json, echo)
    except VllmPortError as exc:  # a rank of a launched group out of step, a peer gone: said, not a traceback
        progress.end(f"error: {exc}")
        return 1
    if args.json:
        print(json.dumps(_json(llm, outputs), ensure_ascii=False))
    elif not echo:
        for prompt, out in zip(prompts, outputs, strict=True):
            _print(prompt, out, llm.tokenizer is not None)
    for out in outputs:
        if out["finish_reason"] == "error":
            print(f"error: {out['error']}", file=sys.stderr)
    return 1 if any(o["finish_reason"] == "error" for o in outputs) else 0


def _generate(
    llm: Any, prompts: list[Any], params: Any, progress: Progress, echo: bool, outputs: list[dict[str, Any]]
) -> None:
    """Stream every request into ``outputs`` (one per prompt), which keep what finished if Ctrl-C stops it."""
    progress.begin("generating")
    if echo:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    done = tokens = 0
    for delta in llm.stream(prompts, params):
        out = outputs[delta.index]
        out["token_ids"] += delta.token_ids
        out["text"] += delta.text
        tokens += len(delta.token_ids)
        if echo and delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
        if delta.finish_reason is not None:
            out["finish_reason"] = delta.finish_reason
            if delta.error:
                out["error"] = delta.error
            done += 1
        rate = tokens / max(progress.elapsed, 1e-9)
        progress.update(f"generating: {done}/{len(prompts)} requests done, {tokens} tokens, {rate:.1f} tokens/s")
    if echo:
        sys.stdout.write("\n")
    rate = tokens / max(progress.elapsed, 1e-9)
    progress.end(
        f"generated {tokens} tokens for {len(prompts)} request(s) in {progress.elapsed:.1f} s ({rate:.1f} tokens/s)"
    )


def _interrupted(
    llm: Any, prompts: list[Any], outputs: list[dict[str, Any]], progress: Progress, as_json: bool, echo: bool
) -> int:
    """After Ctrl-C: the finished requests on stdout, one line on stderr; the exit status."""
    finished = [o for o in outputs if o["finish_reason"] is not None]
    if echo:
        sys.stdout.write("\n")
    if as_json:
        print(json.dumps({**_json(llm, finished), "interrupted": True}, ensure_ascii=False))
    elif not echo:
        for out in finished:
            _print(prompts[out["index"]], out, llm.tokenizer is not None)
    sys.stdout.flush()
    progress.end(
        f"interrupted: {len(finished)} of {len(prompts)} request(s) had finished"
        + (" (printed)" if finished and not echo else "")
        + f"; the others were aborted after {progress.elapsed:.1f} s"
    )
    return INTERRUPTED


def _json(llm: Any, outputs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"outputs": outputs, "platform": llm.platform, "provider_per_op": llm.provider_per_op}


def _print(prompt: Any, out: dict[str, Any], has_tokenizer: bool) -> None:
    shown = prompt if isinstance(prompt, str) else f"token ids {prompt}"
    body = out["text"] if has_tokenizer else f"token ids {out['token_ids']}"
    print(f"--- {shown}\n{body}\n[{out['finish_reason']}]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port generate``."""
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help=f"text prompts (default: {DEFAULT_PROMPT!r})")
    parser.add_argument(
        "--model", default=None, metavar="DIR", help="Hugging Face model directory (default: the bundled model)"
    )
    parser.add_argument(
        "--prompt-token-ids",
        type=_token_ids,
        action="append",
        metavar="1,2,3",
        help="a prompt given as token ids (repeat for more prompts)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, metavar="N", help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0 is greedy (default 0.8)")
    parser.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling mass (default 0.95)")
    parser.add_argument("--top-k", type=int, default=-1, metavar="K", help="keep the K likeliest tokens (-1: all)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0: reproducible)")
    parser.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence tokens")
    add_device_flag(parser, "platform to run on (default: the best available)", metavar="NAME")
    add_model_dtype_flag(parser)
    add_engine_flags(parser)  # vLLM's: --max-num-batched-tokens, --tensor-parallel-size, --async-scheduling, ...
    add_json_flag(parser, "print one JSON object with outputs, platform, providers")
