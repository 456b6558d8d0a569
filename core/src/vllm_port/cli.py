"""The ``vllm-port`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose, dumps, render

    report = diagnose(plugins=args.plugins, device=args.device)
    print(dumps(report) if args.json else render(report))
    if report["selected"] is None:
        return 2  # nothing to run on: a configuration problem, said in report["error"]
    return 0 if report["ok"] else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import dispatch

    return dispatch.main(json_path=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-port", description="The portable hardware layer for LLM inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser("doctor", help="list plugins, the selected platform, bound ops, and smoke-test them")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    doctor.add_argument(
        "--plugins",
        default=None,
        help="plugins to load, e.g. 'cpu,cuda' or '-xpu' (default: $VLLM_PORT_PLUGINS, else all)",
    )
    doctor.add_argument(
        "--device",
        default=None,
        help="platform to select, e.g. 'cpu' (default: $VLLM_PORT_DEVICE, else the best available)",
    )
    doctor.set_defaults(run=_doctor)

    bench = commands.add_parser("bench", help="benchmarks (not tests): see docs/results/")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    dispatch = bench_kinds.add_parser("dispatch", help="overhead of calling a bound op on CPU")
    dispatch.add_argument("--json", default=None, help="also write the results to this JSON file")
    dispatch.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
