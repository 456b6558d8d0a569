"""The bridge runs only a plugin whose certification report holds for the code installed here (no vLLM needed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from vllm_port.discovery import discover
from vllm_port_conformance.certify import digest, source_digest
from vllm_port_vllm.certificate import CERTIFICATE_ENV, certificate_problems, check_certificate
from vllm_port_vllm.errors import BridgeError

REPORT = Path(__file__).resolve().parents[3] / "docs" / "certification" / "cpu" / "report.json"


@pytest.fixture(scope="module")
def cpu():
    (record,) = [r for r in discover(plugins="cpu").plugins if r.name == "cpu"]
    return record


@pytest.fixture(scope="module")
def current() -> dict:
    """The committed CPU report, made to certify the sources installed here (its sha256 recomputed, re-digested)."""
    report = json.loads(REPORT.read_text())
    report["source"] = {**report["source"], **source_digest(report["source"]["packages"])}
    report["digest"] = digest(report)
    return report


def _edited(report: dict, **changes) -> dict:
    out = copy.deepcopy(report)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = out
        for p in parents:
            node = node[p]
        node[leaf] = value
    out["digest"] = digest(out)
    return out


def test_a_report_of_the_installed_sources_certifies(cpu, current) -> None:
    assert certificate_problems(current, cpu) == []


def test_other_sources_are_refused_with_both_digests(cpu, current) -> None:
    (problem,) = certificate_problems(_edited(current, source__sha256="0" * 64), cpu)
    assert "are not those it certified" in problem and "000000000000" in problem


def test_another_plugin_or_version_is_refused(cpu, current) -> None:
    problems = certificate_problems(_edited(current, plugin__name="cuda", plugin__version="9.9"), cpu)
    assert any("not the selected plugin 'cpu'" in p for p in problems)
    assert any("'9.9'" in p for p in problems)


def test_an_edited_report_is_refused(cpu, current) -> None:
    edited = copy.deepcopy(current)
    edited["summary"]["failed"] = 0
    edited["verdict"] = "certified"
    edited["plugin"]["name"] = "cpu "
    assert any("digest mismatch" in p for p in certificate_problems(edited, cpu))


def test_no_certificate_names_the_plugin_and_the_command(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CERTIFICATE_ENV, raising=False)
    with pytest.raises(BridgeError, match=r"plugin 'cpu' .* no certificate.*vllm-port certify cpu --report DIR"):
        check_certificate(cpu)


def test_a_failed_certification_is_refused(cpu, current, tmp_path: Path) -> None:
    failed = copy.deepcopy(current)
    failed["tests"][0]["state"] = "failed"
    failed["summary"]["passed"] -= 1
    failed["summary"]["failed"] += 1
    failed["verdict"], failed["reason"] = "not certified", "1 failed"
    failed["digest"] = digest(failed)
    path = tmp_path / "report.json"
    path.write_text(json.dumps(failed))
    with pytest.raises(BridgeError, match=r"not certified by .*report.json: .*its verdict is 'not certified'"):
        check_certificate(cpu, str(path))
