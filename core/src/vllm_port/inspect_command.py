"""``vllm-port inspect MODEL_DIR``: a model's flat graphs, its placement (``--placement``) or its import (``--import``).

The graphs and their report are :mod:`vllm_port.flat.inspect`'s, the placement report
:mod:`vllm_port.placement.report`'s, the import report :mod:`vllm_port.importer.report`'s; this
module loads the model for them. Exit status: 0 when the report was printed, 2 when the model,
the device or the policy could not be loaded.
"""

from __future__ import annotations

import argparse
import sys

from .cli_flags import add_device_flag, add_json_flag, add_model_dtype_flag

__all__ = ["HELP", "add_arguments", "run"]

HELP = "a model's flat graph: each node's op, bound provider, shapes, layer; fusions fired"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port inspect``."""
    parser.add_argument("model_dir", help="a Hugging Face model directory (config.json + safetensors)")
    add_device_flag(parser, "platform to bind for (default: the selected one)")
    add_model_dtype_flag(parser)
    parser.add_argument("--phase", default="both", choices=["both", "decode", "prefill"], help="graphs to show")
    parser.add_argument("--graph", action="store_true", help="print each graph's stable text form, not a table")
    parser.add_argument("--no-passes", action="store_true", help="the graph as traced, before fusion passes")
    add_json_flag(parser, "print one JSON object (the decode graph at the top)")
    parser.add_argument(
        "--placement",
        default=None,
        metavar="FILE",
        help="a placement policy (.toml/.json): where each node runs, "
        "what crosses between platforms (docs/placement.md)",
    )
    parser.add_argument(
        "--devices",
        default=None,
        metavar="LIST",
        help="with --placement: platforms to load, the engine's first "
        "(default: --device and the platforms the policy names)",
    )
    parser.add_argument(
        "--import",
        dest="import_hf",
        action="store_true",
        help="load the model with transformers and import it: which subgraphs became which contract op, what stays native",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port inspect`` with parsed ``args``; return the exit status."""
    if args.placement:
        return _inspect_placement(args)
    if args.import_hf:
        from .importer.report import inspect_import

        return inspect_import(args)
    return _inspect_graphs(args)


def _inspect_graphs(args: argparse.Namespace) -> int:
    """The decode and prefill graphs of ``args.model_dir`` bound for ``args.device``."""
    import torch

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


def _inspect_placement(args: argparse.Namespace) -> int:
    """Where each node of ``args.model_dir`` runs under the policy ``args.placement``, and what crosses."""
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
