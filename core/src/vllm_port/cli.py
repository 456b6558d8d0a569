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

    return ops.main(args.device, args.dtype, args.ops, args.max_tokens, args.json, args.plot, full=args.full)


def _bench_comm(args: argparse.Namespace) -> int:
    from .bench import comm

    return comm.main(json_path=args.json, device=args.device, max_bytes=args.max_bytes)


def _bench_pool(args: argparse.Namespace) -> int:
    from .bench import pool

    return pool.main(json_path=args.json)


def _bench_swap(args: argparse.Namespace) -> int:
    from .bench import swap

    return swap.main(json_path=args.json, device_name=args.device)


def _inspect_placement(args: argparse.Namespace) -> int:
    import torch

    from .errors import VllmPortError
    from .models import load_config, load_model
    from .placement import EnginePlacement, PlacedModel
    from .placement.report import dumps, placement_report, render

    try:
        devices = [d for d in args.devices.split(",") if d] if args.devices else None
        engine = EnginePlacement.create(args.placement, devices, args.device or "auto")
        dtype = load_config(args.model_dir).dtype if args.dtype == "auto" else getattr(torch, args.dtype)
        model = load_model(args.model_dir, torch.device("cpu"), dtype)  # host memory: weights move from there
        report = placement_report(PlacedModel(model, engine.policy, engine.platforms, dtype, passes=not args.no_passes))
    except VllmPortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dumps(report) if args.json else render(report, str(args.model_dir)))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    import torch

    if getattr(args, "placement", None):
        return _inspect_placement(args)

    if args.import_hf:
        from .importer.report import inspect_import

        return inspect_import(args)

    from .errors import VllmPortError
    from .flat.inspect import dumps, inspect_graphs, render
    from .models import load_config, load_model
    from .runtime import load

    try:
        runtime = load(device=args.device)
        dtype = load_config(args.model_dir).dtype if args.dtype == "auto" else getattr(torch, args.dtype)
        model = load_model(args.model_dir, runtime.device, dtype)
        phases = ("decode", "prefill") if args.phase == "both" else (args.phase,)
        report = inspect_graphs(model, runtime, dtype, phases, passes=not args.no_passes)
    except VllmPortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(dumps(report) if args.json else render(report, str(args.model_dir), graph_text=args.graph))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from .profile.profile_command import run

    return run(args)


def _bench_model(args: argparse.Namespace) -> int:
    from .bench import decode_modes

    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",") if args.modes else decode_modes.MODES
    return decode_modes.main(
        args.device,
        args.shape,
        args.layers,
        batches,
        args.context,
        modes,
        args.dtype,
        args.json,
        args.fast,
        args.rounds,
        args.threads,
    )


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench import engine

    return engine.main(args)


def _bench_placement(args: argparse.Namespace) -> int:
    from .bench import placement

    return placement.main(args)


def _generate(args: argparse.Namespace) -> int:
    from .engine.generate_command import run

    return run(args)


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
    return certify.main(
        args.plugin, args.report, args.json, args.waivers, args.verify, devices=args.devices, checks=args.check
    )


def _check_repro(args: argparse.Namespace) -> int:
    from .ops.debug import replay_command

    return replay_command(args.file, args.provider)


def version_text() -> str:
    """Core's version and contract API, then each installed plugin's distribution and version (none is imported)."""
    from importlib import metadata

    from . import __version__
    from .api import API_VERSION
    from .discovery import ENTRY_POINT_GROUP

    lines = [f"vllm-port {__version__} (contract API {API_VERSION})"]
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        lines.append(f"  plugin {ep.name:<12} {dist.name if dist else '?'} {dist.version if dist else '?'}")
    try:
        lines.append(f"  suite  {'conformance':<12} vllm-port-conformance {metadata.version('vllm-port-conformance')}")
    except metadata.PackageNotFoundError:
        pass
    return "\n".join(lines)


class _PrintVersion(argparse.Action):
    """``--version``: print :func:`version_text` and exit, whatever else the command line holds."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=str(kwargs.get("help", "")))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


#: Options whose value may start with a dash (``--plugins -xpu`` denies a plugin, as the README writes it;
#: ``certify --check -my_rms_norm-`` selects every check of one provider).
DASH_VALUE_OPTIONS = ("--plugins", "--check")


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``["--plugins", "-xpu"]`` -> ``["--plugins=-xpu"]``: argparse would read ``-xpu`` as an unknown option."""
    joined: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in DASH_VALUE_OPTIONS:
            value = next(args, None)
            if value is not None and value.startswith("-") and not value.startswith("--"):
                joined.append(f"{arg}={value}")
                continue
            joined.append(arg)
            if value is not None:
                joined.append(value)
            continue
        joined.append(arg)
    return joined


def _new_plugin(args: argparse.Namespace) -> int:
    from .scaffold import main

    return main(args.name, args.path, args.device_type)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-port", description="The portable hardware layer for LLM inference.")
    parser.add_argument(
        "--version", action=_PrintVersion, help="print the versions of core and of every installed plugin, and exit"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="strict mode, as VLLM_PORT_STRICT=1: every fallback (a skipped plugin or provider, the reference in place "
        "of the platform's kernel, an unknown VLLM_PORT_* setting) is an error; also accepted after the command",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser("doctor", help="list plugins, the selected platform, bound ops, and smoke-test them")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    doctor.add_argument(
        "--plugins",
        default=None,
        help="plugins to load, e.g. 'cpu,cuda', or deny some: '-rocm,-xpu' (default: $VLLM_PORT_PLUGINS, else all)",
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
        "--waivers",
        default=None,
        metavar="FILE",
        help="TOML waiver file (default: the suite's own, vllm_port_conformance/waivers.toml)",
    )
    certify.add_argument("--verify", default=None, metavar="REPORT", help="check a report.json's digest and contents")
    certify.add_argument(
        "--devices",
        type=int,
        default=None,
        metavar="N",
        help="certify for N devices: checks that need more are out of the report's scope (default: every one found)",
    )
    certify.add_argument(
        "--check",
        action="append",
        default=None,
        metavar="ID",
        help="run only the checks whose id contains ID (repeatable): a partial run, never a certificate",
    )
    certify.set_defaults(run=_certify)

    new_plugin = commands.add_parser(
        "new-plugin", help="generate a vendor plugin package that certifies on a device torch knows, then make it yours"
    )
    new_plugin.add_argument("name", help="the plugin's name: lowercase words joined by '_', e.g. mychip")
    new_plugin.add_argument(
        "--path", default=None, metavar="DIR", help="the package's folder (default ./vllm-port-NAME)"
    )
    new_plugin.add_argument(
        "--device-type",
        default="cpu",
        metavar="TYPE",
        help="the torch device type it runs on until yours: cpu (default), cuda, xpu...",
    )
    new_plugin.set_defaults(run=_new_plugin)

    inspect = commands.add_parser(
        "inspect", help="a model's flat graph: each node's op, bound provider, shapes, layer; fusions fired"
    )
    inspect.add_argument("model_dir", help="a Hugging Face model directory (config.json + safetensors)")
    inspect.add_argument("--device", default=None, help="platform to bind for (default: the selected one)")
    inspect.add_argument(
        "--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="default: the checkpoint's"
    )
    inspect.add_argument("--phase", default="both", choices=["both", "decode", "prefill"], help="graphs to show")
    inspect.add_argument("--graph", action="store_true", help="print each graph's stable text form, not a table")
    inspect.add_argument("--no-passes", action="store_true", help="the graph as traced, before fusion passes")
    inspect.add_argument("--json", action="store_true", help="print one JSON object (the decode graph at the top)")
    inspect.add_argument(
        "--placement",
        default=None,
        metavar="FILE",
        help="a placement policy (.toml/.json): where each node runs, "
        "what crosses between platforms (docs/placement.md)",
    )
    inspect.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="with --placement: platforms to load, the engine's first "
        "(default: --device and the platforms the policy names)",
    )
    inspect.add_argument(
        "--import",
        dest="import_hf",
        action="store_true",
        help="load the model with transformers and import it: which subgraphs became which contract op, what stays native",
    )
    inspect.set_defaults(run=_inspect)

    profile = commands.add_parser(
        "profile",
        help="time every node of a decode and a prefill step by stack layer, op and provider; --baseline for CI",
    )
    from .profile.profile_command import add_arguments as add_profile_arguments  # light: no model code loads

    add_profile_arguments(profile)
    profile.set_defaults(run=_profile)

    check_repro = commands.add_parser(
        "check-repro",
        help="replay a reproducer that debug mode (VLLM_PORT_CHECK) wrote: the call, against the reference",
    )
    check_repro.add_argument("file", help="the reproducer's .json file")
    check_repro.add_argument("--provider", default=None, help="run this provider instead of the one it names")
    check_repro.set_defaults(run=_check_repro)

    generate = commands.add_parser("generate", help="generate text with the engine (default: the bundled model)")
    from .engine.generate_command import add_arguments as add_generate_arguments  # light: no model code loads

    add_generate_arguments(generate)
    generate.set_defaults(run=_generate)

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
    ops.add_argument("--max-tokens", type=int, default=32768, help="skip token counts above this")
    ops.add_argument(
        "--full",
        action="store_true",
        help="on a CPU, time every size (up to 32k tokens: many minutes, ~15 GB); by default CPU runs stop at "
        "sizes that finish in minutes within a few GB",
    )
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
    bench_model = bench_kinds.add_parser(
        "model",
        help="decode-step time of a Llama-shaped model: eager, compiled, graph-captured, beside transformers",
    )
    bench_model.add_argument("--device", default=None, help="platform to run on (default: the selected one)")
    bench_model.add_argument(
        "--shape", default="auto", choices=["auto", "llama3-8b", "small"], help="auto: llama3-8b on a GPU, small on CPU"
    )
    bench_model.add_argument("--layers", type=int, default=None, help="fewer layers of the shape (default: all)")
    bench_model.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default 1,64)")
    bench_model.add_argument("--context", type=int, default=1024, help="tokens in each sequence's cache (default 1024)")
    bench_model.add_argument("--modes", default=None, help="comma-separated modes (default: all)")
    bench_model.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    bench_model.add_argument("--fast", action="store_true", help="fewer timing repeats (a smoke run)")
    bench_model.add_argument("--rounds", type=int, default=5, help="timing rounds over all modes (default 5)")
    bench_model.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    bench_model.add_argument("--json", default=None, help="write the results to this JSON file")
    bench_model.set_defaults(run=_bench_model)
    bench_engine = bench_kinds.add_parser(
        "engine", help="offline throughput of LLM.generate beside transformers and vLLM on one workload"
    )
    from .bench.engine import add_arguments as add_engine_arguments  # light: torch only

    add_engine_arguments(bench_engine)
    bench_engine.set_defaults(run=_bench_engine)
    bench_placement = bench_kinds.add_parser(
        "placement", help="decode tok/s with the MLPs or LM head on the host under a device budget, vs all on the host"
    )
    from .bench.placement import add_arguments as add_placement_arguments  # light: torch only

    add_placement_arguments(bench_placement)
    bench_placement.set_defaults(run=_bench_placement)
    return parser


def take_strict(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--strict`` (before a ``--``, wherever it stands), and whether it was there."""
    rest, strict = [], False
    for i, arg in enumerate(argv):
        if arg == "--":
            return rest + list(argv[i:]), strict
        if arg == "--strict":
            strict = True
        else:
            rest.append(arg)
    return rest, strict


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (130 after Ctrl-C)."""
    argv, strict = take_strict(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(join_dash_values(argv))
    try:
        return _run_command(args, strict)
    except KeyboardInterrupt:  # Ctrl-C outside what a command handles itself: one line, no traceback
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _run_command(args: argparse.Namespace, strict: bool) -> int:
    """Run the parsed command, in strict mode when ``strict`` (for the command and what it starts)."""
    import os

    from .faults import STRICT_ENV

    if not strict:
        return int(args.run(args))
    before = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"  # the environment, so that ranks and tools this command starts are strict too
    try:
        return int(args.run(args))
    finally:
        if before is None:
            os.environ.pop(STRICT_ENV, None)
        else:
            os.environ[STRICT_ENV] = before


if __name__ == "__main__":
    sys.exit(main())
