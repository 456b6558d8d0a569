"""Run several ``vllm-port certify`` commands in this one process, each with its output captured.

Usage: ``python certify_batch.py JOBS.json RESULTS.json``; JOBS.json holds a list of argument lists
(``["certify", "mem-leak", "--report", DIR, ...]``), RESULTS.json receives one
``{"returncode", "stdout", "stderr"}`` per job, in order. Each job is exactly the ``vllm-port`` command
(``vllm_port.cli.main``), which runs the suite in a fresh process of its own as always; only the
command's own process is shared, which saves starting Python, torch and discovery for each plugin.
A job that raises is given exit status 3 and the traceback as its stderr; the others still run.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

from vllm_port import cli


def run_job(argv: list[str]) -> dict[str, object]:
    """``vllm-port ARGV``, its exit status and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as exc:  # argparse's usage errors
            status = exc.code if isinstance(exc.code, int) else 2
        except Exception:
            traceback.print_exc()
            status = 3
    return {"returncode": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main(jobs_file: str, results_file: str) -> int:
    jobs = json.loads(Path(jobs_file).read_text())
    Path(results_file).write_text(json.dumps([run_job(argv) for argv in jobs]))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
