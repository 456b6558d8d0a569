"""``vllm-port new-plugin NAME``: generate a vendor plugin package with :mod:`vllm_port.scaffold`.

Exit status: 0 when the package was made, 2 when it could not be (a bad name, a folder in the way).
"""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "generate a vendor plugin package that certifies on a device torch knows, then make it yours"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port new-plugin``."""
    parser.add_argument("name", help="the plugin's name: lowercase words joined by '_', e.g. mychip")
    parser.add_argument("--path", default=None, metavar="DIR", help="the package's folder (default ./vllm-port-NAME)")
    parser.add_argument(
        "--device-type",
        default="cpu",
        metavar="TYPE",
        help="the torch device type it runs on until yours: cpu (default), cuda, xpu...",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port new-plugin`` with parsed ``args``; return the exit status."""
    from .scaffold import main

    return main(args.name, args.path, args.device_type)
