"""``vllm-port certify``'s progress: the recorder's lines followed, shown in place on a terminal, as lines elsewhere."""

from __future__ import annotations

import io
import json

import pytest

from vllm_port_conformance import certify
from vllm_port_conformance import progress as progress_module
from vllm_port_conformance.progress import ProgressFile, ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_sees_one_line_updated_in_place():
    stream = Terminal()
    line = ProgressLine("certify cpu", stream)
    for done in range(1, 4):
        line.update(done, 3, f"test_ops::test_{done}")
    line.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1 and text.endswith("\n")
    assert "certify cpu: 3/3 checks (100%)" in text and "test_ops::test_3" in text


def test_a_log_sees_a_line_per_tenth_and_the_last(monkeypatch):
    stream = io.StringIO()
    line = ProgressLine("certify cpu", stream)
    for done in range(1, 201):
        line.update(done, 200)
    lines = stream.getvalue().splitlines()
    assert (
        len(lines) == 11 and lines[-1]
    )  # the first check, then each tenth.startswith("certify cpu: 200/200 checks (100%)")
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)  # a slow run: a line at least every interval
    line.update(200, 200)
    assert len(stream.getvalue().splitlines()) == 12


def test_the_progress_file_is_followed_by_whole_lines(tmp_path):
    path, stream = tmp_path / "progress", io.StringIO()
    follow = ProgressFile(path, ProgressLine("certify cpu", stream))
    follow.poll()  # not written yet: nothing
    path.write_text("1 4 test_a::x\n2 4 test_b::y\n3 4 test_c")  # the recorder is writing the third line
    follow.poll()
    assert "2/4 checks" in stream.getvalue() and "3/4" not in stream.getvalue()
    with path.open("a") as f:
        f.write("::z\n")
    follow.poll()
    assert stream.getvalue().splitlines()[-1].startswith("certify cpu: 3/4 checks (75%)")


def test_nothing_planned_is_done():
    stream = io.StringIO()
    ProgressLine("certify cpu", stream).update(0, 0)
    assert "0/0 checks (100%)" in stream.getvalue()


@pytest.mark.slow  # the suite's own process starts (torch, discovery): seconds
def test_a_partial_certify_shows_its_progress_on_stderr_and_json_alone_on_stdout(capsys):
    status = certify.main("cpu", None, True, None, None, checks=["test_platform::test_platform_selects_when_available"])
    captured = capsys.readouterr()
    assert status == 1  # a partial run never certifies
    assert json.loads(captured.out)["selection"] == ["test_platform::test_platform_selects_when_available"]
    assert "certify cpu: 1/1 checks (100%)" in captured.err
