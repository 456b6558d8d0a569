"""Settings (issue 25): every known ``VLLM_PORT_*`` setting parses strictly, in every mode; plugins
declare their own (``vllm_port_settings``), strict mode holds ``VLLM_PORT_<PLUGIN>_*`` names to the
declaration, and outside strict mode a misspelt setting prints one warning line naming the closest
known one. Real environment variables (monkeypatch), real plugins (``plugin_factory``).
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from plugin_factory import healthy

from vllm_port import faults
from vllm_port.discovery import discover
from vllm_port.errors import SelectionError, StrictModeError
from vllm_port.ops import _checks

SETTINGS_HOOK = """
from vllm_port.faults import SWITCH_VALUES, Setting

@hookimpl
def vllm_port_settings():
    return {
        "VLLM_PORT_ZSET_FAST": Setting("1 takes the fast path", SWITCH_VALUES),
        "VLLM_PORT_ZSET_MODE": Setting("which kernels", ("small", "large")),
        "VLLM_PORT_ZSET_PATH": Setting("where the kernels are cached"),
    }
"""


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees its own warnings (they are printed once per process)."""
    monkeypatch.setattr(faults, "_warned", set())


# --- core's switches ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["VLLM_PORT_STRICT", "VLLM_PORT_VALIDATE"])
@pytest.mark.parametrize("strict", [None, False, True], ids=["env", "default", "strict"])
def test_a_switch_that_is_no_switch_is_an_error_in_every_mode(monkeypatch, name, strict):
    monkeypatch.setenv(name, "2")
    with pytest.raises(SelectionError) as refused:
        discover(plugins="cpu", strict=strict)
    assert str(refused.value) == (
        f"{name}='2' is not a switch; set it to 1 (on) or 0 (off), or unset it (also accepted: true/false, "
        "yes/no, on/off)"
    )


@pytest.mark.parametrize(
    "value, on", [("1", True), (" ON ", True), ("yes", True), ("0", False), ("off", False), ("", False)]
)
def test_a_switch_reads_the_accepted_spellings(monkeypatch, value, on):
    monkeypatch.setenv("VLLM_PORT_VALIDATE", value)
    monkeypatch.setattr(_checks, "_from_env", None)
    assert _checks.validation_enabled() is on
    assert faults.read_switch("VLLM_PORT_VALIDATE") is on


def test_validate_is_refused_by_the_op_checks_too(monkeypatch):
    """Code that runs ops without discovering (a kernel test) still meets the error, not a silent 'off'."""
    monkeypatch.setenv("VLLM_PORT_VALIDATE", "2")
    monkeypatch.setattr(_checks, "_from_env", None)
    with pytest.raises(SelectionError, match="VLLM_PORT_VALIDATE='2' is not a switch"):
        _checks.validation_enabled()


def test_the_debug_seed_is_checked_even_with_debug_mode_off(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_CHECK_SEED", "x")
    with pytest.raises(SelectionError, match="VLLM_PORT_CHECK_SEED='x' is not an integer seed"):
        discover(plugins="cpu")


# --- the CPU plugin's own setting -----------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_the_cpu_plugins_switch_is_checked_in_every_mode(monkeypatch, strict):
    monkeypatch.setenv("VLLM_PORT_CPU_NATIVE", "maybe")
    with pytest.raises(SelectionError) as refused:
        discover(plugins="cpu", strict=strict)
    message = str(refused.value)
    assert message.startswith("VLLM_PORT_CPU_NATIVE='maybe' is not a value plugin 'cpu' takes for it (0 keeps")
    assert "accepted: '1', '0', 'true', 'false', 'yes', 'no', 'on', 'off', ''" in message


def test_the_cpu_plugin_declares_its_switches_and_reads_them_strictly(monkeypatch):
    from vllm_port_cpu import native

    found = discover(plugins="cpu")
    (cpu,) = [r for r in found.plugins if r.name == "cpu"]
    assert set(cpu.settings) == {"VLLM_PORT_CPU_NATIVE", "VLLM_PORT_CPU_MALLOC"}
    monkeypatch.setenv("VLLM_PORT_CPU_NATIVE", "0")
    assert native._disabled() and discover(plugins="cpu", strict=True).platforms()
    monkeypatch.setenv("VLLM_PORT_CPU_NATIVE", "maybe")
    with pytest.raises(SelectionError, match="VLLM_PORT_CPU_NATIVE='maybe' is not a switch"):
        native._disabled()


# --- plugin-declared settings ---------------------------------------------------------------------


def test_strict_mode_holds_a_plugins_names_to_what_it_declares(install_plugin, monkeypatch):
    install_plugin("zset", healthy("zset", extra=SETTINGS_HOOK))
    monkeypatch.setenv("VLLM_PORT_ZSET_FAST", "1")
    monkeypatch.setenv("VLLM_PORT_ZSET_PATH", "/anything/goes")
    assert discover(plugins="cpu,zset", strict=True).platforms()
    monkeypatch.setenv("VLLM_PORT_ZSET_FAAST", "1")
    with pytest.raises(
        StrictModeError, match=r"unknown setting VLLM_PORT_ZSET_FAAST \(did you mean VLLM_PORT_ZSET_FAST\?\)"
    ):
        discover(plugins="cpu,zset", strict=True)


def test_a_plugin_that_declares_nothing_owns_no_names_in_strict_mode(install_plugin, monkeypatch):
    install_plugin("zbare", healthy("zbare"))
    monkeypatch.setenv("VLLM_PORT_ZBARE_ANYTHING", "1")
    with pytest.raises(StrictModeError, match="unknown setting VLLM_PORT_ZBARE_ANYTHING"):
        discover(plugins="cpu,zbare", strict=True)


def test_a_plugin_kept_out_keeps_its_prefix(install_plugin, monkeypatch):
    """Its declaration is never read (its code never runs), so its names cannot be checked: they pass."""
    install_plugin("zset", healthy("zset", extra=SETTINGS_HOOK))
    monkeypatch.setenv("VLLM_PORT_ZSET_WHATEVER", "1")
    assert discover(plugins="cpu", strict=True).platforms()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_value_outside_a_plugins_choices_is_an_error_in_every_mode(install_plugin, monkeypatch, strict):
    install_plugin("zset", healthy("zset", extra=SETTINGS_HOOK))
    monkeypatch.setenv("VLLM_PORT_ZSET_MODE", "medium")
    with pytest.raises(
        SelectionError,
        match=r"VLLM_PORT_ZSET_MODE='medium' is not a value plugin 'zset' takes for it \(which kernels\); "
        r"accepted: 'small', 'large'",
    ):
        discover(plugins="cpu,zset", strict=strict)
    monkeypatch.setenv("VLLM_PORT_ZSET_MODE", " Large ")
    assert discover(plugins="cpu,zset", strict=strict).platforms()


def test_a_plugin_declaring_another_prefix_is_skipped_naming_the_rule(install_plugin):
    install_plugin(
        "zbad",
        healthy(
            "zbad",
            extra="""
            from vllm_port.faults import Setting

            @hookimpl
            def vllm_port_settings():
                return {"VLLM_PORT_DEVICE": Setting("steals a core setting")}
            """,
        ),
    )
    (record,) = [r for r in discover(plugins="cpu,zbad").plugins if r.name == "zbad"]
    assert record.error == (
        "vllm_port_settings declares 'VLLM_PORT_DEVICE'; a plugin's settings are named VLLM_PORT_ZBAD_* (its own prefix)"
    )


# --- the warning outside strict mode --------------------------------------------------------------


def test_a_misspelt_setting_warns_once_naming_the_closest(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_PORT_DEVCE", "cpu")
    with caplog.at_level(logging.WARNING, logger="vllm_port.faults"):
        discover(plugins="cpu")
        discover(plugins="cpu")
    lines = [r.getMessage() for r in caplog.records if "VLLM_PORT_DEVCE" in r.getMessage()]
    assert lines == [
        "vllm-port: unknown setting VLLM_PORT_DEVCE is ignored; did you mean VLLM_PORT_DEVICE? "
        "(strict mode, VLLM_PORT_STRICT=1, refuses it)"
    ]


def test_strict_mode_refuses_instead_of_warning(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_PORT_DEVCE", "cpu")
    with caplog.at_level(logging.WARNING, logger="vllm_port.faults"), pytest.raises(StrictModeError):
        discover(plugins="cpu", strict=True)
    assert not [r for r in caplog.records if "VLLM_PORT_DEVCE" in r.getMessage()]


@pytest.mark.slow
def test_the_warning_is_one_line_on_stderr_of_a_real_process(monkeypatch):
    monkeypatch.setenv("VLLM_PORT_DEVCE", "cpu")
    monkeypatch.setenv("VLLM_PORT_CPU_NATIV", "0")
    run = subprocess.run(
        [sys.executable, "-c", "import vllm_port; vllm_port.load(device='cpu'); vllm_port.load(device='cpu')"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = [line for line in run.stderr.splitlines() if "VLLM_PORT_DEVCE " in line or "VLLM_PORT_CPU_NATIV " in line]
    assert lines == [
        "vllm-port: unknown setting VLLM_PORT_CPU_NATIV is ignored; did you mean VLLM_PORT_CPU_NATIVE? "
        "(strict mode, VLLM_PORT_STRICT=1, refuses it)",
        "vllm-port: unknown setting VLLM_PORT_DEVCE is ignored; did you mean VLLM_PORT_DEVICE? "
        "(strict mode, VLLM_PORT_STRICT=1, refuses it)",
    ]


def test_a_name_close_to_nothing_gets_no_guess():
    assert faults.closest_setting("VLLM_PORT_ZZZZZZZZZZZZ", faults.SETTINGS) is None
    assert faults.closest_setting("VLLM_PORT_STRCT", faults.SETTINGS) == "VLLM_PORT_STRICT"
