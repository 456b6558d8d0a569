"""Reports how many examples each fuzz test ran per op (and writes them to ``FUZZ_REPORT``, when set).

Triton's interpreter is made to round float32 -> bfloat16 as GPUs do, by the Triton tests' own
conftest (run here too: this folder may be collected without that one), so the error statistics of
``Op.check`` judge the kernels, not the interpreter's truncation.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from fuzz_budget import COUNTS

_TRITON_CONFTEST = Path(__file__).parent.parent / "triton" / "conftest.py"
if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    _spec = importlib.util.spec_from_file_location("vllm_port_triton_interpreter_rounding", _TRITON_CONFTEST)
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))  # patches the interpreter once (idempotent)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not COUNTS:
        return
    kinds = sorted({kind for kind, _ in COUNTS})
    ops = sorted({op for _, op in COUNTS})
    terminalreporter.write_sep("-", "fuzz examples run per op")
    terminalreporter.write_line(f"{'op':22s}" + "".join(f"{k:>14s}" for k in kinds))
    for op in ops:
        terminalreporter.write_line(f"{op:22s}" + "".join(f"{COUNTS[kind, op]:>14d}" for kind in kinds))
    path = os.environ.get("FUZZ_REPORT")
    if path:
        with open(path, "w") as out:
            json.dump({f"{kind}/{op}": n for (kind, op), n in sorted(COUNTS.items())}, out, indent=1)
