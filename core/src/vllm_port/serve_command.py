"""``vllm-port serve [MODEL_DIR]``: an OpenAI-compatible HTTP server over the engine (docs/serve.md).

Loads the model (the bundled one by default, as ``generate``), then answers ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (``stream: true`` as server-sent events), ``/health``
and ``/metrics`` on ``--host``/``--port`` until Ctrl-C. Needs the ``serve`` extra
(``pip install 'vllm-port[serve]'``). Exit status: 0 after Ctrl-C or SIGTERM, 2 when the model,
the device or the extra is missing.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .cli_flags import (
    ENGINE_FLAGS,
    add_device_flag,
    add_engine_flags,
    add_model_dtype_flag,
    add_plugins_flag,
    engine_kwargs,
)

__all__ = ["HELP", "add_arguments", "run"]

HELP = "serve the engine over HTTP, OpenAI-compatible (default: the bundled model)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port serve``."""
    parser.add_argument(
        "model", nargs="?", default=None, metavar="MODEL_DIR", help="model directory (default: bundled)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="the name clients pass as 'model' (repeat for aliases; default: MODEL_DIR as given, or 'bundled')",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        metavar="N",
        help="requests that may wait beyond the running ones; more are answered 503 with Retry-After (default 1024)",
    )
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file to use")
    parser.add_argument("--seed", type=int, default=None, help="seeds requests that give no seed")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    add_device_flag(parser, "platform to run on (default: the best available)", metavar="NAME")
    add_model_dtype_flag(parser)
    add_plugins_flag(parser)
    # vLLM's: --max-num-batched-tokens, --async-scheduling, --enforce-eager, ...; not external_launcher: the server
    # runs in one process, and launched ranks would each need the same requests (docs/multi-node.md)
    add_engine_flags(parser, *(f for f in ENGINE_FLAGS if f != "distributed_executor_backend"))


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port serve`` with parsed ``args``; return the exit status."""
    try:
        import uvicorn

        from .serve.app import build_app
        from .serve.async_engine import AsyncEngine
    except ImportError as exc:
        print(f"error: vllm-port serve needs the serve extra ({exc}); pip install 'vllm-port[serve]'", file=sys.stderr)
        return 2
    from .engine.chat_template import ChatTemplate
    from .engine.llm import LLM
    from .errors import VllmPortError

    if args.max_waiting < 0:
        print(f"error: --max-waiting is {args.max_waiting}; it must be 0 or more", file=sys.stderr)
        return 2
    try:
        llm = LLM(
            args.model,
            device=args.device or "auto",
            dtype=args.dtype,
            seed=args.seed,
            plugins=args.plugins,
            **engine_kwargs(args),
        )
        template = ChatTemplate.from_file(args.chat_template, llm.model_dir) if args.chat_template else None
    except (VllmPortError, ValueError) as exc:  # ChatTemplateError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    names = args.served_model_name or [args.model or "bundled"]
    app = build_app(AsyncEngine(llm, args.max_waiting), names, template)
    print(
        f"vllm-port serve: {llm.model_dir} on {llm.platform} as {names[0]!r} at http://{args.host}:{args.port}/v1 "
        f"(max_model_len {llm.max_model_len}, {llm.runner.pool.num_blocks} KV blocks)",
        file=sys.stderr,
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGINT and SIGTERM, then raises the signal again under the handler it
    # found: a quiet one here, so that a SIGTERM (what systemd and Kubernetes send) ends with status 0 too
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        signal.signal(signal.SIGTERM, previous)
    llm.close()
    return 0
