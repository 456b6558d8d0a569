"""The command line's own options: ``--version`` and ``--plugins`` with a deny list, as the README writes it."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

import vllm_port
from vllm_port.cli import build_parser, join_dash_values, main


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


def test_doctor_with_the_readmes_deny_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--plugins", "-cuda,-rocm,-xpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["selected"] == "cpu"
    assert sorted(report["excluded"]) == ["cuda", "rocm", "xpu"]
