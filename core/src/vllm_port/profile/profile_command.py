"""``vllm-port profile``: the layered profile of a model's steps from the command line, and its baseline check.

Exit status: 0 when the profile was made (and nothing regressed against ``--baseline``), 1 when
something regressed, 2 on bad input (an unreadable or incomparable baseline, a model or device
that cannot be loaded, options the model cannot run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from ..cli_flags import add_device_flag, add_json_file_flag, add_model_dtype_flag
from ..errors import VllmPortError
from .schema import DEFAULT_MIN_SHARE_PCT, DEFAULT_THRESHOLD_PCT, IMPORTERS, PHASES

__all__ = ["HELP", "add_arguments", "run"]

HELP = "time every node of a decode and a prefill step by stack layer, op and provider; --baseline for CI"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``vllm-port profile``."""
    parser.add_argument(
        "model_dir",
        nargs="?",
        default=None,
        metavar="MODEL_DIR",
        help="Hugging Face model directory (default: the bundled model)",
    )
    add_device_flag(parser, "platform to run on (default: the best available)", metavar="NAME")
    parser.add_argument(
        "--importer",
        default=None,
        choices=IMPORTERS,
        help="profile the model as LLM(MODEL_DIR, importer=...) runs it: 'hf' loads it with transformers and "
        "imports it (default: the core model definition)",
    )
    parser.add_argument("--batch", type=int, default=8, metavar="N", help="sequences in each step (default 8)")
    parser.add_argument(
        "--context",
        type=int,
        default=256,
        metavar="L",
        help="tokens per sequence: prefilled, or in the cache when decoding (default 256)",
    )
    add_model_dtype_flag(parser)
    parser.add_argument("--phase", default="both", choices=["both", *PHASES], help="steps to profile (default both)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        metavar="R",
        help="profiled steps per phase; nodes take the median (default 10)",
    )
    parser.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        metavar="S",
        help="seconds spent timing each step's wall time (default 0.5)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="also compile each step and report compile time, graph breaks"
    )
    add_json_file_flag(parser, "write the profile (and any comparison) to this JSON file", metavar="F")
    parser.add_argument(
        "--baseline", default=None, metavar="F", help="a previous --json to compare against: exit 1 on regression"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD_PCT,
        metavar="PCT",
        help=f"a time must grow by more than PCT%% to regress (default {DEFAULT_THRESHOLD_PCT:g})",
    )
    parser.add_argument(
        "--min-share",
        type=float,
        default=DEFAULT_MIN_SHARE_PCT,
        metavar="PCT",
        help=f"ignore changes under PCT%% of the step's time (default {DEFAULT_MIN_SHARE_PCT:g})",
    )
    parser.add_argument("--nodes", action="store_true", help="list every node, not only the slowest")
    parser.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")


def run(args: argparse.Namespace) -> int:
    """Run ``vllm-port profile`` with parsed ``args``; return the exit status."""
    import torch

    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        return _run(args)
    except VllmPortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # called in-process (tests, notebooks): leave torch as it was


def _run(args: argparse.Namespace) -> int:
    import torch

    from ..data import bundled_model_dir
    from ..runtime import load
    from .collect import profile_model  # the tracer and the profiler: only to profile
    from .compare import check_comparable, compare, load_baseline
    from .render import render, render_comparison
    from .subject import identity, load_profile_model

    baseline = load_baseline(args.baseline) if args.baseline else None  # refuse a bad file before any work
    if baseline is not None and baseline.get("importer") != args.importer:  # before the model loads and imports
        check_comparable({**baseline, "importer": args.importer}, baseline, f"baseline {args.baseline}")
    model_dir = Path(args.model_dir) if args.model_dir else bundled_model_dir()
    runtime = load(device=args.device)
    model = load_profile_model(
        model_dir, runtime, None if args.dtype == "auto" else getattr(torch, args.dtype), args.importer
    )
    dtype = model.dtype
    phases = PHASES if args.phase == "both" else (args.phase,)
    if baseline is not None:
        facts = identity(model, runtime, dtype, args.batch, args.context)
        check_comparable({**facts, "phases": dict.fromkeys(phases)}, baseline, f"baseline {args.baseline}")
    stages = _StageLine(sys.stderr)
    try:
        report = profile_model(
            model,
            runtime,
            dtype,
            batch=args.batch,
            context=args.context,
            phases=phases,
            repeats=args.repeats,
            compile=args.compile,
            min_run_time=args.min_time,
            model_dir=str(model_dir),
            progress=stages,
        )
    finally:
        stages.close()
    comparison: dict[str, Any] | None = None
    if baseline is not None:
        comparison = compare(report, baseline, args.threshold, args.min_share)
        report["comparison"] = {"baseline": str(args.baseline), **comparison}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(render(report, all_nodes=args.nodes))
    if comparison is not None:
        print()
        print(render_comparison(comparison, str(args.baseline)))
        return 0 if comparison["ok"] else 1
    return 0


class _StageLine:
    """The profile's stages on stderr as they start, with the seconds so far: one line updated in place on
    a terminal, a line each elsewhere (a profile is a handful of stages, so a log stays short)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.monotonic()

    def __call__(self, stage: str) -> None:
        text = f"profile: {stage} [{time.monotonic() - self.start:.0f} s]"
        self.stream.write(f"\r\x1b[K{text}" if self.tty else f"{text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K")  # the report follows on a clean line
            self.stream.flush()
