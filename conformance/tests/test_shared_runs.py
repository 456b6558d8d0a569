"""``OncePerRun``: a run shared by the tests is made once per pytest run, by whichever xdist worker asks first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from certify_helpers import HERE
from shared_runs import OncePerRun

#: one xdist worker, as a process: asks for the shared run ``key`` and prints what it got
_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from shared_runs import OncePerRun

    basetemp, key, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

    def make(folder):
        with log.open("a") as f:
            f.write(f"{folder}\\n")
        time.sleep(0.5)  # the other worker asks meanwhile
        if key == "broken":
            raise ValueError("the run broke")
        return {"folder": str(folder)}

    try:
        print(json.dumps(OncePerRun.for_run(basetemp)(key, make)))
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
    """
)


def _two_workers(run_dir: Path, key: str) -> tuple[list[dict], list[str]]:
    log = run_dir / f"{key}.log"
    procs = []
    for worker in ("gw0", "gw1"):
        basetemp = run_dir / f"popen-{worker}"
        basetemp.mkdir(exist_ok=True)
        env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(HERE)}
        cmd = [sys.executable, "-c", _WORKER, str(basetemp), key, str(log)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    got = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    return got, log.read_text().splitlines()


def test_two_workers_share_one_run(tmp_path):
    got, made = _two_workers(tmp_path, "shared")
    assert len(made) == 1, made  # made by one worker only
    assert got[0] == got[1] == {"folder": made[0]}
    assert Path(made[0]).parent == tmp_path / "once-per-run"  # beside the workers' own basetemps


def test_a_failed_run_is_reported_to_both_workers_and_not_repeated(tmp_path):
    got, made = _two_workers(tmp_path, "broken")
    assert len(made) == 1, made
    assert all(
        "the shared run 'broken' failed" in g["error"] and "ValueError: the run broke" in g["error"] for g in got
    )


def test_without_xdist_the_run_lives_in_this_sessions_basetemp(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    once = OncePerRun.for_run(tmp_path)
    calls = []
    assert once("k", lambda folder: calls.append(folder) or len(calls)) == 1
    assert once("k", lambda folder: calls.append(folder) or len(calls)) == 1  # kept, not made again
    assert len(calls) == 1 and calls[0].parent == tmp_path / "once-per-run"


@pytest.mark.xdist_group("shared-runs-group-id")
def test_under_loadgroup_a_grouped_test_carries_its_group_in_its_id(request: pytest.FixtureRequest) -> None:
    """What keeps a shared run's readers on one worker: ``--dist loadgroup`` groups tests by the ``@group`` of their id.

    pytest-xdist 3.8's own suffix no longer reaches the id under pytest 9.2; conftest.py writes it.
    Without it every group is split and workers wait on each other's shared runs.
    """
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a worker of a pytest-xdist --dist loadgroup run (-n 0 runs here)")
    assert request.node.nodeid.endswith(
        "::test_under_loadgroup_a_grouped_test_carries_its_group_in_its_id@shared-runs-group-id"
    )
