"""The command line's own options (``--version``, ``--plugins`` with a deny list, as the README writes it), its table
of commands, flags never abbreviated, output into a closed pipe, and messages naming what the user typed."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import vllm_port
from vllm_port.cli import COMMANDS, build_parser, join_dash_values, main


def test_version_names_core_and_every_installed_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"vllm-port {vllm_port.__version__} (contract API {vllm_port.API_VERSION})"
    assert f"  plugin cpu          vllm-port-cpu {metadata.version('vllm-port-cpu')}" in lines


@pytest.mark.parametrize(
    ("argv", "plugins"),
    [
        (["doctor", "--plugins", "-xpu"], "-xpu"),  # the README's form: argparse alone reads -xpu as an option
        (["doctor", "--plugins", "-rocm,-xpu", "--json"], "-rocm,-xpu"),
        (["doctor", "--plugins=-xpu"], "-xpu"),
        (["doctor", "--plugins", "cpu,cuda"], "cpu,cuda"),
    ],
)
def test_plugins_accepts_a_deny_list(argv: list[str], plugins: str) -> None:
    assert build_parser().parse_args(join_dash_values(argv)).plugins == plugins


def test_join_dash_values_leaves_other_arguments_alone() -> None:
    argv = ["doctor", "--json", "--device", "cpu", "--plugins"]
    assert join_dash_values(argv) == argv
    assert join_dash_values(["doctor", "--plugins", "--json"]) == ["doctor", "--plugins", "--json"]


@pytest.mark.slow
def test_doctor_with_the_readmes_deny_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--plugins", "-cuda,-rocm,-xpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["selected"] == "cpu"
    assert sorted(report["excluded"]) == ["cuda", "rocm", "xpu"]


# -------------------------------------------------------------------------------------------------
# The table of commands; --help and --version without torch
# -------------------------------------------------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every command and subcommand parser under it, each with its ``prog``."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_command_module_declares_help_arguments_and_run() -> None:
    for name, path in COMMANDS.items():
        module = importlib.import_module(path)
        assert isinstance(module.HELP, str) and "\n" not in module.HELP, name
        assert callable(module.add_arguments) and callable(module.run), name
    assert sorted(COMMANDS) == sorted(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


#: Run in a fresh interpreter: every --help and --version the CLI has, then which heavy modules got imported.
NO_TORCH_PROBE = """
import sys
from vllm_port.cli import COMMANDS, main
from vllm_port.bench.bench_command import KINDS

argvs = [["--help"], ["--version"], *([name, "--help"] for name in COMMANDS), *(["bench", k, "--help"] for k in KINDS)]
for argv in argvs:
    try:
        main(argv)
    except SystemExit as stop:
        assert stop.code == 0, (argv, stop.code)
    else:
        raise AssertionError(f"{argv} did not exit")
heavy = ("torch", "numpy", "transformers", "fastapi", "uvicorn", "jinja2", "prometheus_client", "httpx")
print(len(argvs), len(KINDS), sorted(m for m in heavy if m in sys.modules))
"""


def test_help_and_version_import_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH_PROBE], capture_output=True, text=True, env={**os.environ, "COLUMNS": "100"}
    )
    assert done.returncode == 0, done.stderr
    count, kinds, imported = done.stdout.splitlines()[-1].split(" ", 2)
    assert int(count) == 2 + len(COMMANDS) + int(kinds) and imported == "[]", done.stdout[-500:]


def test_placement_shapes_are_the_benchmarks_shapes() -> None:
    from vllm_port.bench import placement
    from vllm_port.bench.bench_command import PLACEMENT_SHAPES

    assert list(PLACEMENT_SHAPES) == sorted(placement.SHAPES)


# -------------------------------------------------------------------------------------------------
# No abbreviated flags
# -------------------------------------------------------------------------------------------------


def test_no_parser_takes_abbreviations() -> None:
    parsers = dict(_parsers(build_parser()))
    assert {"vllm-port", "vllm-port generate", "vllm-port bench", "vllm-port bench engine"} <= set(parsers)
    assert [prog for prog, parser in parsers.items() if parser.allow_abbrev] == []


@pytest.mark.parametrize(
    ("argv", "error", "meant"),
    [
        (
            ["generate", "--max-token", "4"],
            "vllm-port generate: error: unrecognized arguments: --max-token",
            "--max-tokens",
        ),
        (["generate", "--temp=0"], "vllm-port generate: error: unrecognized arguments: --temp=0", "--temperature"),
        (
            ["bench", "engine", "--hidden", "64"],
            "vllm-port bench engine: error: unrecognized arguments: --hidden 64",
            "--hidden-size",
        ),
        (["doctor", "--plugin", "cpu"], "vllm-port doctor: error: unrecognized arguments: --plugin cpu", "--plugins"),
    ],
)
def test_an_abbreviated_flag_is_an_error_naming_it(
    argv: list[str], error: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert error in err
    assert f"did you mean {meant}?" in err and "never abbreviated" in err


def test_an_unknown_argument_without_a_near_flag_gets_no_hint(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["doctor", "extra"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "vllm-port doctor: error: unrecognized arguments: extra" in err and "did you mean" not in err


# -------------------------------------------------------------------------------------------------
# Output into a closed pipe (`| head`): quiet, exit 1
# -------------------------------------------------------------------------------------------------


def _into_closed_pipe(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``vllm-port ARGV`` with stdout a pipe whose reader is gone, as after ``| head -1`` has read its line."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # before the command starts: its first write to stdout fails with EPIPE, every time
    try:
        return subprocess.run(
            [sys.executable, "-m", "vllm_port.cli", *argv], stdout=write_end, stderr=subprocess.PIPE, text=True
        )
    finally:
        os.close(write_end)


def test_version_into_a_closed_pipe_ends_quietly() -> None:
    done = _into_closed_pipe("--version")
    assert (done.returncode, done.stderr) == (1, "")  # 1: Python's own exit status after EPIPE


@pytest.mark.parametrize("argv", [["--help"], ["doctor", "--help"], ["bench", "engine", "--help"]])
def test_help_into_a_closed_pipe_ends_quietly(argv: list[str]) -> None:
    done = _into_closed_pipe(*argv)
    assert done.stderr == "" and done.returncode in (0, 1)  # 0 where argparse drops its own failed write


@pytest.mark.slow
def test_a_commands_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    done = _into_closed_pipe("new-plugin", "chip", "--path", str(tmp_path / "chip"))
    assert (done.returncode, done.stderr) == (1, "")
    assert (tmp_path / "chip" / "pyproject.toml").is_file()  # the command ran; only its report went nowhere


# -------------------------------------------------------------------------------------------------
# Unknown names: each message names the argument the user gave
# -------------------------------------------------------------------------------------------------


def test_certify_an_unknown_plugin_names_the_plugin_argument(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm_port_conformance")
    assert main(["certify", "nosuchchip"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown plugin 'nosuchchip' (the plugin to certify)")
    assert "installed plugins: cpu" in err and "--plugins" not in err and "VLLM_PORT_PLUGINS" not in err


def test_certify_a_plugin_list_is_an_unknown_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm_port_conformance")
    assert main(["certify", "cpu,cuda"]) == 2  # one plugin is certified at a time; a filter is not a name
    assert "unknown plugin 'cpu,cuda'" in capsys.readouterr().err


#: A placement policy whose one rule names a platform that no plugin has.
POLICY_NAMING_NOSUCH = '[[rules]]\nlabel = "mlp elsewhere"\nplatform = "nosuch"\npart = "mlp"\n'


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        ([], "the placement policy's platform='nosuch' names no installed platform"),
        (["--devices", "cpu,nosuch2"], "devices='nosuch2' names no installed platform"),
        (["--device", "nosuch3"], "--device='nosuch3' names no installed platform"),
    ],
)
def test_inspect_a_placement_names_who_named_the_unknown_platform(
    extra: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_port.data import bundled_model_dir

    policy = tmp_path / "policy.toml"
    policy.write_text(POLICY_NAMING_NOSUCH)
    assert main(["inspect", str(bundled_model_dir()), "--placement", str(policy), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}; platforms: cpu")


def test_bench_placement_names_the_host_flag_of_an_unknown_platform(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "placement", "--host", "nosuch", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: --host='nosuch' names no installed platform; platforms: cpu")
