"""``vllm-port doctor``: the report of :func:`vllm_port.doctor.diagnose` as text, or as JSON with ``--json``.

Exit status: 0 when every check passed, 1 when one failed, 2 when nothing could be selected (a
configuration problem, said in the report's ``error``).
"""

from __future__ import annotations

import argparse

from .cli_flags import add_device_flag, add_json_flag, add_plugins_flag

__all__ = ["HELP", "add_arguments", "run"]

HELP = "list plugins, the selected platform, bound ops, and smoke-test them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port doctor``."""
    add_json_flag(parser, "print one JSON object instead of text")
    add_plugins_flag(parser)
    add_device_flag(parser, "platform to select, e.g. 'cpu' (default: $VLLM_PORT_DEVICE, else the best available)")


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port doctor`` with parsed ``args``; return the exit status."""
    from .doctor import diagnose, dumps, render

    report = diagnose(plugins=args.plugins, device=args.device)
    print(dumps(report) if args.json else render(report))
    if report["selected"] is None:
        return 2  # nothing to run on: a configuration problem, said in report["error"]
    return 0 if report["ok"] else 1
