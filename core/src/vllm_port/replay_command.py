"""``vllm-port check-repro FILE``: replay a reproducer that debug mode wrote, against the reference.

The replay itself is :func:`vllm_port.ops.debug.replay_command`'s (exit status 1 when the fault
reproduces, 0 when the call now agrees with the reference, 2 when it cannot run); this module only
declares the command, and imports nothing heavy until it runs.
"""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "replay a reproducer that debug mode (VLLM_PORT_CHECK) wrote: the call, against the reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``check-repro``'s arguments: the reproducer's file and an optional other provider."""
    parser.add_argument("file", help="the reproducer's .json file")
    parser.add_argument("--provider", default=None, help="run this provider instead of the one it names")


def run(args: argparse.Namespace) -> int:
    """Replay ``args.file``: 1 when the fault reproduces, 0 when the call now agrees, 2 when it cannot run."""
    from .ops.debug import replay_command

    return replay_command(args.file, args.provider)
