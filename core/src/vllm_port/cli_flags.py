"""The flags several ``vllm-port`` commands share, declared once: ``--plugins``, ``--device``, ``--json``, ``--dtype``.

A command module calls these from its ``add_arguments``; each keeps the flag's name, kind and default
the same in every command, and takes the help where a command means something narrower by it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_device_flag", "add_json_file_flag", "add_json_flag", "add_model_dtype_flag", "add_plugins_flag"]

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
