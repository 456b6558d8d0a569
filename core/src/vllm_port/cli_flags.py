"""The flags several ``vllm-port`` commands share, declared once: ``--plugins``, ``--device``, ``--json``, ``--dtype``,
and vLLM's engine flags (``--max-num-batched-tokens``, ``--async-scheduling``, ...: :func:`add_engine_flags`).

A command module calls these from its ``add_arguments``; each keeps the flag's name, kind and default
the same in every command, and takes the help where a command means something narrower by it.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = [
    "ENGINE_FLAGS",
    "add_device_flag",
    "add_engine_flags",
    "add_json_file_flag",
    "add_json_flag",
    "add_model_dtype_flag",
    "add_plugins_flag",
    "engine_kwargs",
]

#: What ``--device`` means unless a command says otherwise.
DEVICE_HELP = "platform to run on (default: the selected one)"


def add_plugins_flag(parser: argparse.ArgumentParser) -> None:
    """``--plugins LIST``: which plugins to load, allowed or denied (``-rocm,-xpu``), as ``VLLM_PORT_PLUGINS``."""
    parser.add_argument(
        "--plugins",
        default=None,
        help="plugins to load, e.g. 'cpu,cuda', or deny some: '-rocm,-xpu' (default: $VLLM_PORT_PLUGINS, else all)",
    )


def add_device_flag(
    parser: argparse.ArgumentParser, help: str = DEVICE_HELP, default: str | None = None, metavar: str | None = None
) -> None:
    """``--device NAME``: the platform to select, as ``VLLM_PORT_DEVICE`` (``None``: the selected one)."""
    parser.add_argument("--device", default=default, metavar=metavar, help=help)


def add_json_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--json``: print the command's result as JSON on stdout instead of text."""
    parser.add_argument("--json", action="store_true", help=help)


def add_json_file_flag(
    parser: argparse.ArgumentParser, help: str = "also write the results to this JSON file", metavar: str | None = None
) -> None:
    """``--json FILE``: also write the command's results to FILE (benchmarks, profiles)."""
    parser.add_argument("--json", default=None, metavar=metavar, help=help)


def add_model_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the dtype a model runs in, ``auto`` for its checkpoint's."""
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="default: the checkpoint's"
    )


#: ``vllm serve``'s engine flags, as this project's ``EngineConfig`` fields: field -> (flag, argparse options).
#: Every default is ``None`` (absent), so ``LLM``'s own defaults stay the only ones.
ENGINE_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "max_model_len": ("--max-model-len", dict(type=int, metavar="N", help="longest context, prompt and output")),
    "max_num_seqs": ("--max-num-seqs", dict(type=int, metavar="N", help="requests running at once (default 256)")),
    "max_num_batched_tokens": (
        "--max-num-batched-tokens",
        dict(
            type=int, metavar="N", help="tokens one step may run; longer prompts are prefilled in chunks (default 2048)"
        ),
    ),
    "block_size": (
        "--block-size",
        dict(type=int, metavar="N", help="tokens per KV-cache block (default: the platform's)"),
    ),
    "kv_cache_memory": (
        "--kv-cache-memory",
        dict(type=float, metavar="X", help="KV-cache budget: a fraction (0, 1] of the free memory, or bytes"),
    ),
    "gpu_memory_utilization": (
        "--gpu-memory-utilization",
        dict(type=float, metavar="F", help="the fraction (0, 1] of the device's total memory to use, as vLLM's"),
    ),
    "swap_space": (
        "--swap-space",
        dict(
            type=float,
            metavar="GIB",
            help="host memory to swap preempted requests to, in GiB as vLLM's (default: as "
            "much as the KV cache, at most 4 GiB, where the platform has a host tier)",
        ),
    ),
    "kv_cache_dtype": ("--kv-cache-dtype", dict(choices=["auto", "fp8", "fp8_e4m3"], help="the KV cache's dtype")),
    "enable_prefix_caching": (
        "--enable-prefix-caching",
        dict(action=argparse.BooleanOptionalAction, help="reuse cached blocks of equal prompt prefixes (default on)"),
    ),
    "enforce_eager": ("--enforce-eager", dict(action="store_true", help="replay no captured graphs")),
    "async_scheduling": (
        "--async-scheduling",
        dict(
            action=argparse.BooleanOptionalAction,
            help="schedule each step before reading the last one's tokens (the same outputs; one device; "
            "default on for one accelerator, off on cpu)",
        ),
    ),
    "tensor_parallel_size": (
        "--tensor-parallel-size",
        dict(type=int, metavar="N", help="ranks to shard the model over (default 1)"),
    ),
    "pipeline_parallel_size": (
        "--pipeline-parallel-size",
        dict(type=int, metavar="N", help="stages to split the model's layers into, one rank each (default 1)"),
    ),
    "distributed_executor_backend": (
        "--distributed-executor-backend",
        dict(
            choices=["mp", "external_launcher"],
            help="mp (default): spawn the ranks here; external_launcher: this "
            "process is one rank torchrun started (docs/multi-node.md)",
        ),
    ),
    "tokenizer": ("--tokenizer", dict(metavar="DIR", help="a local tokenizer directory or tokenizer.json to use")),
    "generation_config": (
        "--generation-config",
        dict(
            metavar="auto|vllm|DIR",
            help="sampling defaults for requests that leave them out: auto (default) the model's "
            "generation_config.json, vllm none, or a directory's",
        ),
    ),
}


#: vLLM's short spellings
_SHORT = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}


def add_engine_flags(parser: argparse.ArgumentParser, *fields: str) -> None:
    """vLLM's engine flags for ``fields`` (keys of :data:`ENGINE_FLAGS`; all when none are named), default absent."""
    for field in fields or ENGINE_FLAGS:
        flag, options = ENGINE_FLAGS[field]
        names = (flag, _SHORT[field]) if field in _SHORT else (flag,)
        parser.add_argument(*names, dest=field, default=None, **options)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM``/``EngineConfig`` arguments that ``args`` set through :func:`add_engine_flags` (absent ones left out)."""
    kwargs = {f: getattr(args, f) for f in ENGINE_FLAGS if getattr(args, f, None) is not None}
    if "swap_space" in kwargs:  # GiB on the command line, as vLLM's; bytes in LLM
        kwargs["swap_space"] = int(kwargs["swap_space"] * (1 << 30))
    if "kv_cache_memory" in kwargs and kwargs["kv_cache_memory"] > 1:  # bytes
        kwargs["kv_cache_memory"] = int(kwargs["kv_cache_memory"])
    return kwargs
