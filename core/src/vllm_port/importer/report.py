"""``vllm-port inspect MODEL_DIR --import``: what the importer mapped to which contract op, and what stays native."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from typing import Any

import torch

__all__ = ["inspect_import", "render_import"]


def render_import(report: dict[str, Any]) -> str:
    """The import report (``ImportReport.to_json()``) as text: mapped subgraphs, native nodes, notes."""
    lines = [f"import of {report['architecture']}: {len(report['mapped'])} subgraphs mapped to contract ops"]
    rows = [("piece", "recognised", "contract ops", "replaced nodes", "detail")]
    for m in report["mapped"]:
        rows.append((m["piece"], m["pattern"], ", ".join(m["ops"]), str(len(m["replaced"])), m["detail"]))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows]
    native = report["native"]
    lines.append("")
    lines.append(f"native torch nodes (not views): {len(native)}")

    def label(node: dict[str, str]) -> str:  # a dtype cast shows its dtypes: aten._to_copy.default (float32 -> ...)
        return f"{node['op']} ({node['cast']})" if "cast" in node else node["op"]

    by_op = Counter(label(n) for n in native)
    for op, count in sorted(by_op.items()):
        pieces = sorted({n["piece"] for n in native if label(n) == op})
        lines.append(f"  {op} x{count}  in {', '.join(pieces)}")
    lines.append(f"view and layout nodes: {report['views']}")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    if report.get("verify_error") is not None:
        lines.append(f"import check against transformers: max relative logit error {report['verify_error']:.3g}")
    return "\n".join(lines)


def inspect_import(args: Any) -> int:
    """The ``inspect --import`` command: import ``args.model_dir`` with transformers, print both reports."""
    from ..errors import VllmPortError
    from ..flat.inspect import dumps, inspect_graphs, render
    from ..runtime import load
    from .engine import load_hf_model
    from .imported_model import import_model

    try:
        runtime = load(device=args.device)
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        hf_model = load_hf_model(args.model_dir, dtype)
        model = import_model(hf_model, runtime, dtype)
        del hf_model
        phases = ("decode", "prefill") if args.phase == "both" else (args.phase,)
        graphs = inspect_graphs(model, runtime, model.dtype, phases, passes=not args.no_passes)
    except VllmPortError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    imported = model.report.to_json()
    if args.json:
        print(json.dumps({"import": imported, **json.loads(dumps(graphs))}, indent=2, default=str))
    else:
        print(render_import(imported))
        print()
        print(render(graphs, os.fspath(args.model_dir), graph_text=args.graph))
    return 0
