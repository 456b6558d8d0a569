"""Progress of a long run on stderr: checks done of checks planned, for ``vllm-port certify``.

The suite runs in a subprocess; its recorder (:mod:`vllm_port_conformance.recorder`) appends one
line per finished check to the file named by :data:`PROGRESS_ENV` (``DONE PLANNED CHECK-ID``), and
the parent follows that file (:class:`ProgressFile`) while it waits. Shown on a terminal as one line
updated in place; elsewhere (a log, CI) a line at every tenth of the run and at least once a
minute, so a long run is never silent and a log is never flooded. Never on stdout: ``--json`` keeps
stdout for the report.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

__all__ = ["PROGRESS_ENV", "ProgressFile", "ProgressLine"]

#: The environment variable that names the file the recorder appends its progress lines to.
PROGRESS_ENV = "VLLM_PORT_CERTIFY_PROGRESS"
#: Seconds between two lines when stderr is not a terminal (unless a tenth of the run is done sooner).
LOG_INTERVAL_S = 60.0


class ProgressLine:
    """Checks done of checks planned, on ``stream`` (default stderr).

    :param label: what runs (``"certify cpu"``).
    """

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last_line = self.start
        self._last_tenth = -1
        self._shown = False

    def update(self, done: int, planned: int, check: str = "") -> None:
        """Show that ``done`` of ``planned`` checks have finished, the latest being ``check``."""
        elapsed = time.monotonic() - self.start
        percent = 100 * done // planned if planned else 100
        text = f"{self.label}: {done}/{planned} checks ({percent}%), {elapsed:.0f} s"
        if self.tty:
            self.stream.write(f"\r\x1b[K{text} {check}"[:200])
            self.stream.flush()
            self._shown = True
            return
        tenth = 10 * done // planned if planned else 10
        if tenth > self._last_tenth or time.monotonic() - self._last_line >= LOG_INTERVAL_S or done == planned:
            self._last_tenth, self._last_line = tenth, time.monotonic()
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """End the line updated in place (on a terminal), so what follows starts on its own line."""
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()


class ProgressFile:
    """Follows the recorder's progress file and reports its newest line to a :class:`ProgressLine`."""

    def __init__(self, path: Path, line: ProgressLine) -> None:
        self.path, self.line = path, line
        self._offset = 0
        self._last: tuple[int, int, str] | None = None

    def poll(self) -> None:
        """Read what the recorder appended since the last poll; show the newest progress, if any."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return  # not written yet
        end = chunk.rfind(b"\n") + 1  # only whole lines: the recorder may be writing the next one
        self._offset += end
        for raw in chunk[:end].splitlines():
            done, planned, check = [*raw.decode("utf-8", "replace").split(" ", 2), ""][:3]
            if done.isdigit() and planned.isdigit():
                self._last = (int(done), int(planned), check)
        if self._last is not None and end:
            self.line.update(*self._last)
