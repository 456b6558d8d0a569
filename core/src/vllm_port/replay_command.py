"""``vllm-port check-repro FILE``: replay a reproducer that debug mode wrote, against the reference.

Debug mode (``VLLM_PORT_CHECK``, :mod:`vllm_port.ops.debug`) writes the inputs of a provider's
failing call to a reproducer. This command loads the plugins, selects the reproducer's platform,
finds the provider it names (or ``--provider``), runs the same call on the rebuilt inputs and
makes the same check as debug mode did. Exit status: 1 when the fault reproduces, 0 when the call
now agrees with the reference, 2 when it cannot run (no such file, platform or provider).

Nothing heavy (torch, the runtime) is imported before :func:`run`: the CLI declares the arguments first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["HELP", "add_arguments", "replay", "run"]

HELP = "replay a reproducer that debug mode (VLLM_PORT_CHECK) wrote: the call, against the reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare ``check-repro``'s arguments: the reproducer's file and an optional other provider."""
    parser.add_argument("file", help="the reproducer's .json file")
    parser.add_argument("--provider", default=None, help="run this provider instead of the one it names")


def run(args: argparse.Namespace) -> int:
    """Replay ``args.file``: 1 when the fault reproduces, 0 when the call now agrees, 2 when it cannot run."""
    from .errors import VllmPortError

    try:
        problem, record = replay(args.file, args.provider)
    except (OSError, ValueError, KeyError, VllmPortError) as exc:
        print(f"error: cannot replay {args.file}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    ran = record["replayed"]
    what = f"op {record['op']!r}, {ran['provider']!r} of plugin {ran['plugin']!r}, {record['dtype']} on {record['platform']!r}"
    print(f"recorded: {record['problem']}")
    if problem:
        print(f"reproduced ({what}): {problem}")
        return 1
    print(f"not reproduced ({what}): the call agrees with the reference now")
    return 0


def replay(path: str | os.PathLike[str], provider: str | None = None) -> tuple[str | None, dict[str, Any]]:
    """Re-run a reproducer on this machine: ``(problem or None, record)``.

    Loads the plugins, selects the reproducer's platform, finds the provider it names (or
    ``provider``) and runs the same check as debug mode did.

    :raises SelectionError: when the platform or the provider is not installed here.
    """
    import torch

    from .errors import SelectionError
    from .ops.debug import compare_with_reference, load_repro, metadata_problem
    from .runtime import load

    record = json.loads(Path(path).read_text(encoding="utf-8"))
    runtime = load(device=record.get("platform"))
    op = runtime.registry.ops.get(record.get("op", ""))
    if op is None:
        raise SelectionError(f"{path}: op {record.get('op')!r} is not an op of this vllm-port")
    name = provider or record["provider"]
    found = [p for p in runtime.registry.candidates(op.name, runtime.platform.name) if p.name == name]
    if not found:
        names = ", ".join(p.name for p in runtime.registry.candidates(op.name, runtime.platform.name))
        raise SelectionError(
            f"{path}: no provider {name!r} of op {op.name!r} on platform {runtime.platform.name!r}; candidates: {names}"
        )
    chosen = found[0]
    dtype = getattr(torch, record["dtype"])
    _, args = load_repro(path, runtime.device)
    mutated = [i for i, n in enumerate(op.signature.parameters) if n in op.mutates]
    before = {i: args[i].clone() for i in mutated}
    replayed = {**record, "replayed": {"provider": chosen.name, "plugin": chosen.plugin}}
    try:
        out = chosen.fn(*args)
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}", replayed
    problem = metadata_problem(op, args, out)
    if problem is None and chosen.name != "reference":
        problem = compare_with_reference(op, chosen, args, before, out, dtype)
    return problem, replayed
