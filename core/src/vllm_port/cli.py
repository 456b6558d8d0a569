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


def _bench_dispatch(args: argparse.Namespace) -> int:
    from .bench import dispatch

    return dispatch.main(json_path=args.json)


def _bench_ops(args: argparse.Namespace) -> int:
    from .bench import ops

    return ops.main(args.device, args.dtype, args.ops, args.max_tokens, args.json, args.plot)


def _bench_comm(args: argparse.Namespace) -> int:
    from .bench import comm

    return comm.main(json_path=args.json, device=args.device, max_bytes=args.max_bytes)


def _bench_pool(args: argparse.Namespace) -> int:
    from .bench import pool

    return pool.main(json_path=args.json)


def _bench_swap(args: argparse.Namespace) -> int:
    from .bench import swap

    return swap.main(json_path=args.json, device_name=args.device)


def _certify(args: argparse.Namespace) -> int:
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
    return certify.main(args.plugin, args.report, args.json, args.waivers, args.verify)


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

    certify = commands.add_parser(
        "certify", help="run the conformance suite on a plugin and write a verifiable certification report"
    )
    certify.add_argument("plugin", nargs="?", default=None, help="installed plugin to certify, e.g. cpu")
    certify.add_argument("--report", default=None, metavar="DIR", help="write DIR/report.json and DIR/report.md")
    certify.add_argument("--json", action="store_true", help="print the report as JSON")
    certify.add_argument(
        "--waivers", default=None, metavar="FILE", help="TOML waiver file (default: conformance/waivers.toml)"
    )
    certify.add_argument("--verify", default=None, metavar="REPORT", help="check a report.json's digest and contents")
    certify.set_defaults(run=_certify)

    bench = commands.add_parser("bench", help="benchmarks (not tests): see docs/results/")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    dispatch = bench_kinds.add_parser("dispatch", help="overhead of calling a bound op on CPU")
    dispatch.add_argument("--json", default=None, help="also write the results to this JSON file")
    dispatch.set_defaults(run=_bench_dispatch)
    ops = bench_kinds.add_parser(
        "ops", help="every provider of every op against eager, Inductor and the device's ceilings"
    )
    ops.add_argument("--device", default=None, help="platform to run on (default: the selected one)")
    ops.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ops.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    ops.add_argument("--max-tokens", type=int, default=32768, help="skip token counts above this (CPU runs: ~1024)")
    ops.add_argument("--json", default=None, help="write the results to this JSON file")
    ops.add_argument("--plot", default=None, help="draw fraction-of-ceiling vs tokens to this PNG file")
    ops.set_defaults(run=_bench_ops)
    pool = bench_kinds.add_parser("pool", help="KV block pool ops per second and usable KV capacity")
    pool.add_argument("--json", default=None, help="also write the results to this JSON file")
    pool.set_defaults(run=_bench_pool)
    swap = bench_kinds.add_parser(
        "swap", help="migrator swap bandwidth device <-> pinned host vs a plain pinned copy_ (needs a GPU)"
    )
    swap.add_argument("--json", default=None, help="also write the results to this JSON file")
    swap.add_argument("--device", default=None, help="platform to run on (default: the selected one)")
    swap.set_defaults(run=_bench_swap)
    comm = bench_kinds.add_parser(
        "comm", help="all_reduce bus bandwidth through the comm contract against torch.distributed, 2 ranks"
    )
    comm.add_argument("--json", default=None, help="also write the results to this JSON file")
    comm.add_argument("--device", default=None, help="platform to run on (default: the selected one)")
    comm.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message in bytes (default 64 MB)")
    comm.set_defaults(run=_bench_comm)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
