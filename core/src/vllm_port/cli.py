"""The ``vllm-port`` command: a table of subcommands, each declared by its own module.

A command module (one row of :data:`COMMANDS`) holds ``HELP`` (its line in ``vllm-port --help``),
``add_arguments(parser)`` and ``run(args) -> int`` (the exit status), and imports nothing heavy at
module level: what a command needs (torch, models, plugins) is imported by its ``run``, so
``vllm-port --help``, ``vllm-port CMD --help`` and ``--version`` never import torch. The flags
commands share are declared once, in :mod:`vllm_port.cli_flags`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NoReturn

__all__ = ["COMMANDS", "build_parser", "main"]

#: ``vllm-port NAME`` -> the module that declares and runs it, in the order ``vllm-port --help`` lists them;
#: each is imported by :func:`build_parser`, none by importing this module.
COMMANDS: dict[str, str] = {
    "doctor": "vllm_port.doctor_command",
    "certify": "vllm_port.certify_command",
    "new-plugin": "vllm_port.new_plugin_command",
    "inspect": "vllm_port.inspect_command",
    "profile": "vllm_port.profile.profile_command",
    "check-repro": "vllm_port.replay_command",
    "generate": "vllm_port.engine.generate_command",
    "serve": "vllm_port.serve_command",
    "bench": "vllm_port.bench.bench_command",
}

#: The exit status after stdout's reader went away (``vllm-port doctor --json | head -1``), as Python's own.
BROKEN_PIPE = 1


class CommandParser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviated flag (``--max-token`` is not ``--max-tokens``).

    ``add_subparsers`` makes its subparsers of the parent's class, so every command and subcommand
    parser refuses abbreviations too.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``vllm-port``: its own two options, then one subparser per row of :data:`COMMANDS`."""
    parser = CommandParser(prog="vllm-port", description="The portable hardware layer for LLM inference.")
    parser.add_argument(
        "--version", action=_PrintVersion, help="print the versions of core and of every installed plugin, and exit"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="strict mode, as VLLM_PORT_STRICT=1: every fallback (a skipped plugin or provider, the reference in place "
        "of the platform's kernel, an unknown VLLM_PORT_* setting) is an error; also accepted after the command",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module_path in COMMANDS.items():
        add_command(commands, name, importlib.import_module(module_path))
    return parser


def add_command(commands: argparse._SubParsersAction, name: str, module: ModuleType) -> argparse.ArgumentParser:
    """Declare ``module``'s command as ``name``: its help line, its arguments, its run function."""
    parser = commands.add_parser(name, help=module.HELP)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
    return parser


def version_text() -> str:
    """Core's version and contract API, then each installed plugin's distribution and version (none is imported)."""
    from importlib import metadata

    from . import __version__
    from .api import API_VERSION, ENTRY_POINT_GROUP

    lines = [f"vllm-port {__version__} (contract API {API_VERSION})"]
    for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep, "dist", None)
        lines.append(f"  plugin {ep.name:<12} {dist.name if dist else '?'} {dist.version if dist else '?'}")
    try:
        lines.append(f"  suite  {'conformance':<12} vllm-port-conformance {metadata.version('vllm-port-conformance')}")
    except metadata.PackageNotFoundError:
        pass
    return "\n".join(lines)


class _PrintVersion(argparse.Action):
    """``--version``: print :func:`version_text` and exit, whatever else the command line holds."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=str(kwargs.get("help", "")))

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_text())
        parser.exit()


#: Options whose value may start with a dash (``--plugins -xpu`` denies a plugin, as the README writes it;
#: ``certify --check -my_rms_norm-`` selects every check of one provider).
DASH_VALUE_OPTIONS = ("--plugins", "--check")


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """``["--plugins", "-xpu"]`` -> ``["--plugins=-xpu"]``: argparse would read ``-xpu`` as an unknown option."""
    joined: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in DASH_VALUE_OPTIONS:
            value = next(args, None)
            if value is not None and value.startswith("-") and not value.startswith("--"):
                joined.append(f"{arg}={value}")
                continue
            joined.append(arg)
            if value is not None:
                joined.append(value)
            continue
        joined.append(arg)
    return joined


def take_strict(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--strict`` (before a ``--``, wherever it stands), and whether it was there."""
    rest, strict = [], False
    for i, arg in enumerate(argv):
        if arg == "--":
            return rest + list(argv[i:]), strict
        if arg == "--strict":
            strict = True
        else:
            rest.append(arg)
    return rest, strict


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (130 after Ctrl-C, 1 when stdout's reader went away)."""
    try:
        try:
            return _main(sys.argv[1:] if argv is None else argv)
        finally:
            sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe could not be handled
    except BrokenPipeError:  # `vllm-port doctor --json | head -1`: the reader has what it wanted
        _discard_stdout()
        return BROKEN_PIPE


def _main(argv: Sequence[str]) -> int:
    argv, strict = take_strict(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(join_dash_values(argv))
    if unknown:
        _refuse_unknown(parser, args, unknown)
    try:
        return _run_command(args, strict)
    except KeyboardInterrupt:  # Ctrl-C outside what a command handles itself: one line, no traceback
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def _run_command(args: argparse.Namespace, strict: bool) -> int:
    """Run the parsed command, in strict mode when ``strict`` (for the command and what it starts)."""
    from .faults import STRICT_ENV

    if not strict:
        return int(args.run(args))
    before = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"  # the environment, so that ranks and tools this command starts are strict too
    try:
        return int(args.run(args))
    finally:
        if before is None:
            os.environ.pop(STRICT_ENV, None)
        else:
            os.environ[STRICT_ENV] = before


def _refuse_unknown(parser: argparse.ArgumentParser, args: argparse.Namespace, unknown: list[str]) -> NoReturn:
    """Exit 2 with the usage of the command that was given ``unknown``, and the flag each unknown one may mean."""
    command = _command_parser(parser, args)
    flags = [flag for action in command._actions for flag in action.option_strings if flag.startswith("--")]
    hints = [
        f"{given}: did you mean {' or '.join(meant)}?"
        for given in (arg.partition("=")[0] for arg in unknown if arg.startswith("--"))
        if (meant := _meant(given, flags))
    ]
    hint = f" ({' '.join(hints)} Flags are never abbreviated)" if hints else ""
    command.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


def _meant(given: str, flags: list[str]) -> list[str]:
    """The flags ``given`` may abbreviate, else the one it is closest to (a typo), else none."""
    return [f for f in flags if f.startswith(given)] or difflib.get_close_matches(given, flags, n=1)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command ``args`` names: ``vllm-port bench engine ...`` -> bench engine's."""
    while True:  # argparse keeps a parser's subcommands in its one _SubParsersAction
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subcommands[0].dest, None) if subcommands else None
        if chosen is None:
            return parser
        parser = subcommands[0].choices[chosen]


def _discard_stdout() -> None:
    """Point stdout at the null device, so the interpreter's last flush at exit finds no closed pipe.

    What Python's documentation recommends for SIGPIPE (the ``signal`` module's note on it); a
    stdout without a file descriptor (captured by a test) is left alone.
    """
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
