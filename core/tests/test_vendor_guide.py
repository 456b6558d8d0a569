"""docs/vendor-guide.md runs as written: its code blocks, in order, on a plugin generated into a temporary folder.

How each kind of block runs (never touching this venv's packages):

- ``bash``: line by line in a shell whose PATH starts with this venv's ``bin``; ``cd`` moves the
  working folder. ``pip install -e .`` does what an editable install does, outside this venv: the
  package, built as a wheel, goes into a folder on ``PYTHONPATH`` (its metadata and entry points), and
  its ``src`` goes ahead of that folder, so the blocks that change a file are seen without installing
  again. ``tox`` lines run in ``core/tests/scaffold/test_scaffold.py``; a command the guide repeats
  later runs at its last place only.
- ``python`` headed ``# add to PATH`` or ``# new file PATH``: changes the generated package. Any
  other: runs in a fresh interpreter in the package's folder, on CPU, with ``TRITON_INTERPRET=1``.
- ``toml``: parses, and its ``dependencies`` line replaces the generated one.
- ``text``: output; the failure it shows is the one the replay block prints.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_port.scaffold import new_plugin

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "vendor-guide.md"
BIN = Path(sys.executable).parent
_FILE_BLOCK = re.compile(r"# (add to|new file) (\S+)")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    section: str


def blocks() -> list[Block]:
    """The guide's fenced code blocks, in order, with the ``##`` section each sits in."""
    found, section = [], ""
    for match in re.finditer(r"^## ([^\n]+)$|^```(\w+)\n(.*?)^```$", GUIDE.read_text(encoding="utf-8"), re.S | re.M):
        if match.group(1):
            section = match.group(1)
        else:
            found.append(Block(match.group(2), match.group(3), section))
    return found


def _command(line: str) -> str:
    """A shell line without its comment and its leading variable assignments: what it runs."""
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"\w+=.*", words[0]):
        words.pop(0)
    return " ".join(words)


class Guide:
    """Runs the guide's blocks against one generated package; keeps every command's output."""

    def __init__(self, work: Path) -> None:
        self.cwd = work
        self.site = work / "site"
        self.outputs: list[tuple[str, str]] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_PORT_")}
        self.env.pop("TRITON_INTERPRET", None)  # only where the guide sets it
        self.env.update(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(self.site))
        self.installed = False

    def run(self, args: list[str] | str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            args, cwd=self.cwd, env=env or self.env, shell=isinstance(args, str), capture_output=True, text=True
        )
        out = done.stdout + done.stderr
        assert done.returncode == 0, f"{args}\n{out[-5000:]}"
        self.outputs.append((str(args), out))
        return out

    def install(self) -> None:
        """``pip install -e .``, outside this venv: a wheel into ``site``, the package's ``src`` ahead of it on
        PYTHONPATH (an editable install: later edits of the sources are seen as they are made)."""
        if self.installed:
            return
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        self.run([*pip, "--target", str(self.site), "."])
        self.env["PYTHONPATH"] = os.pathsep.join([str(self.cwd / "src"), str(self.site)])
        self.installed = True

    def shell(self, block: Block, later: list[str]) -> None:
        for line in block.code.splitlines():
            command = _command(line)
            if not command:
                continue
            later.remove(command)  # this occurrence
            if command.startswith("cd "):
                self.cwd = self.cwd / command[3:]
            elif command == "pip install -e .":
                self.install()
            elif command.startswith("tox "):
                assert command == "tox -e conformance", line  # the environment test_scaffold.py runs
            elif command not in later:  # a command the guide repeats runs at its last place
                self.run(line)

    def change_file(self, block: Block) -> None:
        action, path = _FILE_BLOCK.match(block.code).groups()  # type: ignore[union-attr]
        target = self.cwd / path
        assert target.exists() == (action == "add to"), f"{action} {path}: exists={target.exists()}"
        before = target.read_text(encoding="utf-8") + "\n\n" if action == "add to" else ""
        target.write_text(before + block.code, encoding="utf-8")
        self.install()

    def python(self, block: Block) -> str:
        script = self.cwd / "guide_snippet.py"
        script.write_text(block.code)
        try:
            return self.run([sys.executable, str(script)], env={**self.env, "TRITON_INTERPRET": "1"})
        finally:
            script.unlink()

    def toml(self, block: Block) -> None:
        line = f"dependencies = {json.dumps(tomllib.loads(block.code)['dependencies'])}"
        pyproject = self.cwd / "pyproject.toml"
        pyproject.write_text(re.sub(r"^dependencies = .*$", line, pyproject.read_text(), count=1, flags=re.M))


def _output(guide: Guide, fragment: str) -> str:
    found = [out for args, out in guide.outputs if fragment in args]
    assert found, f"no command with {fragment!r} ran: {[a for a, _ in guide.outputs]}"
    return found[-1]


@pytest.mark.slow
def test_the_guide_runs_as_written(tmp_path: Path) -> None:
    guide = Guide(tmp_path)
    everything = blocks()
    assert {b.lang for b in everything} <= {"bash", "python", "toml", "text"}
    shell_lines = [_command(line) for b in everything if b.lang == "bash" for line in b.code.splitlines()]
    later = [c for c in shell_lines if c]
    replayed = failure_shown = ""
    for block in everything:
        if block.lang == "bash":
            guide.shell(block, later)
        elif block.lang == "python" and _FILE_BLOCK.match(block.code):
            guide.change_file(block)
        elif block.lang == "python":
            out = guide.python(block)
            replayed = out if "rms_norm.check" in block.code else replayed
        elif block.lang == "toml":
            guide.toml(block)
        else:
            failure_shown = " ".join(block.code.split())

    assert "Selected platform: mychip" in _output(guide, "vllm-port doctor")
    checks = _output(guide, "pytest -q")
    assert " passed" in checks and "failed" not in checks
    assert "mychip: certified" in _output(guide, "vllm-port certify mychip")
    assert "linear_silu_and_mul x4" in _output(guide, "vllm-port inspect")
    assert "report verified: mychip: certified" in _output(guide, "certify --verify")
    # the failure the guide shows is the one the replay prints, number for number
    shown = failure_shown.split("case 'llama3-8b decode': ", 1)[1].removesuffix(" | ...")
    assert shown == " ".join(replayed.split()), replayed


def _sink_lines() -> tuple[int, int]:
    """Lines a vendor writes to sink rms_norm: non-blank lines of the ops.py block, and all of them with the dependency."""
    section = [b for b in blocks() if b.section.startswith("Sink one op")]
    ops = next(b for b in section if b.code.startswith("# add to src/vllm_port_mychip/ops.py"))
    in_ops = sum(1 for line in ops.code.splitlines()[1:] if line.strip())  # the first line says where it goes
    return in_ops, in_ops + sum(1 for b in section if b.lang == "toml")


def test_the_guide_states_the_lines_it_measures() -> None:
    in_ops, total = _sink_lines()
    text = GUIDE.read_text(encoding="utf-8")
    assert f"into a hand-written kernel: {total}**" in text and f"{in_ops} lines in `ops.py`, one dependency" in text
    assert total < 50  # the goal


def test_the_guide_states_the_size_of_the_generated_package(tmp_path: Path) -> None:
    sources = sorted((new_plugin("mychip", tmp_path / "p").root / "src" / "vllm_port_mychip").glob("*.py"))
    lines = sum(len(source.read_text(encoding="utf-8").splitlines()) for source in sources)
    prose = " ".join(GUIDE.read_text(encoding="utf-8").split())  # wherever the lines of the paragraph break
    assert len(sources) == 6 and f"The six files are {lines} lines in all" in prose


@pytest.mark.parametrize("block", [b for b in blocks() if b.lang == "python"], ids=lambda b: b.section[:24])
def test_every_python_block_is_clean_under_ruff(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "block.py"
    path.write_text(block.code)
    # the generated package's rules; F821: a block added to a generated file uses its names (PRIORITY, KERNELS...)
    for args in (["check", "--select", "E,F,W,I,B,UP,RUF", "--ignore", "F821"], ["format", "--check"]):
        done = subprocess.run(
            [BIN / "ruff", *args, "--isolated", "--line-length", "120", str(path)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
