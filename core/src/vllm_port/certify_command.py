"""``vllm-port certify``: run the conformance suite on a plugin, or check a report, with ``vllm_port_conformance``.

The suite is its own distribution (``vllm-port-conformance``); without it this command says how to
install it and exits 2. Exit statuses otherwise are :func:`vllm_port_conformance.certify.main`'s.
"""

from __future__ import annotations

import argparse
import sys

from .cli_flags import add_json_flag

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run the conformance suite on a plugin and write a verifiable certification report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port certify``."""
    parser.add_argument("plugin", nargs="?", default=None, help="installed plugin to certify, e.g. cpu")
    parser.add_argument("--report", default=None, metavar="DIR", help="write DIR/report.json and DIR/report.md")
    add_json_flag(parser, "print the report as JSON")
    parser.add_argument(
        "--waivers",
        default=None,
        metavar="FILE",
        help="TOML waiver file (default: the suite's own, vllm_port_conformance/waivers.toml)",
    )
    parser.add_argument("--verify", default=None, metavar="REPORT", help="check a report.json's digest and contents")
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="certify for N devices: checks that need more are out of the report's scope (default: every one found)",
    )
    parser.add_argument(
        "--check",
        action="append",
        default=None,
        metavar="ID",
        help="run only the checks whose id contains ID (repeatable): a partial run, never a certificate",
    )
    parser.add_argument(
        "--vllm",
        choices=("auto", "skip", "require"),
        default="auto",
        help="the last stage, the plugin's kernels inside vLLM through the bridge against vLLM alone: run where vLLM "
        "and vllm-port-vllm are installed (auto), never (skip), or refuse to certify without them (require)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port certify`` with parsed ``args``; return the exit status."""
    try:
        from vllm_port_conformance import certify
    except ImportError as exc:
        print(
            f"error: vllm-port certify needs the conformance suite ({exc}); "
            "install it: pip install vllm-port-conformance (in a checkout: pip install -e ./conformance)",
            file=sys.stderr,
        )
        return 2
    if (args.plugin is None) == (args.verify is None):
        print("error: give either a PLUGIN to certify or --verify REPORT.json", file=sys.stderr)
        return 2
    return certify.main(
        args.plugin,
        args.report,
        args.json,
        args.waivers,
        args.verify,
        devices=args.devices,
        checks=args.check,
        vllm=args.vllm,
    )
