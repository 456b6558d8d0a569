"""``vllm-port certify``: the verdict, the report, and ``--verify``."""

from __future__ import annotations

import json

import pytest
from certify_helpers import Certified, run_certify

from vllm_port import cli
from vllm_port_conformance import certify


@pytest.fixture(scope="session")
def cpu_certified(tmp_path_factory) -> Certified:
    """``vllm-port certify cpu --report DIR``, run once per session (the suite takes ~20 s)."""
    return run_certify("cpu", report_dir=tmp_path_factory.mktemp("certify") / "cpu")


def test_cpu_is_certified_with_a_report(cpu_certified):
    assert cpu_certified.returncode == 0, cpu_certified.output
    assert "cpu: certified" in cpu_certified.stdout
    report = cpu_certified.report
    assert (cpu_certified.report_dir / "report.md").read_text().startswith("# vllm-port certification: cpu")
    assert report["verdict"] == "certified"
    assert report["summary"]["passed"] == report["summary"]["total"] == len(report["tests"]) > 100
    assert {t["state"] for t in report["tests"]} == {"passed"}
    assert report["device"]["available"] and report["device"]["devices"]
    assert set(report["versions"]) >= {"vllm-port", "plugin", "vllm-port-conformance", "torch"}
    assert report["git"]["commit"]
    assert "derandomize=True" in report["seeds"]["hypothesis"]
    rms = [c for c in report["coverage"] if c["op"] == "rms_norm"]
    assert rms and all(c["passed"] == c["total"] > 0 for c in rms)
    assert {t["op"] for t in report["tolerances"]} >= {"rms_norm", "paged_attention", "sample"}
    assert all(t["reason"] for t in report["tolerances"])
    assert report["digest"] == certify.digest(report)


def _verify(tmp_path, report, capsys):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return cli.main(["certify", "--verify", str(path)]), capsys.readouterr().out


def test_verify_accepts_the_untouched_report(cpu_certified, capsys):
    assert cli.main(["certify", "--verify", str(cpu_certified.report_dir / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "report verified: cpu: certified" in out
    assert "source: the same as the packages installed here" in out


def test_the_report_carries_a_digest_of_the_sources_it_ran(cpu_certified):
    source = cpu_certified.report["source"]
    assert source["packages"] == ["vllm_port", "vllm_port_conformance", "vllm_port_cpu"]
    assert source["files"] > 50 and source == certify.source_digest("cpu")
    assert certify.source_digest("cuda")["sha256"] != source["sha256"]  # another plugin's package instead


def test_the_commit_the_runner_names_wins_over_the_checkout(monkeypatch):
    monkeypatch.delenv(certify.COMMIT_ENV, raising=False)
    here = certify._git()
    assert "from" not in here
    monkeypatch.setenv(certify.COMMIT_ENV, "0123abc")
    got = certify._git()
    assert got["commit"] == "0123abc" and got["dirty"] == "unknown" and certify.COMMIT_ENV in got["from"]


def test_verify_rejects_an_edited_field(cpu_certified, tmp_path, capsys):
    report = cpu_certified.report
    report["device"]["devices"][0]["name"] = "NVIDIA H200"
    status, out = _verify(tmp_path, report, capsys)
    assert status == 1
    assert "report rejected" in out and "digest mismatch" in out and "edited" in out


def test_verify_rejects_a_removed_test(cpu_certified, tmp_path, capsys):
    report = cpu_certified.report
    del report["tests"][0]
    status, out = _verify(tmp_path, report, capsys)
    assert status == 1
    assert "digest mismatch" in out and "incomplete" in out


def test_verify_rejects_a_forged_verdict_even_with_a_fresh_digest():
    report = _minimal_failed()
    report["verdict"] = "certified"
    report["digest"] = certify.digest(report)
    assert any("inconsistent" in p for p in certify.verify(report))
    report["tests"][0]["state"] = "flaky"
    report["digest"] = certify.digest(report)
    assert any("not one of" in p for p in certify.verify(report))


def _minimal_failed():
    tests = [{"id": "test_ops::x", "state": "failed", "duration_s": 0.1, "message": "boom"}]
    report = {k: None for k in certify.REQUIRED_KEYS}
    report.update(
        tests=tests,
        summary=certify._summary(tests),
        device={"available": True, "reason": "here"},
        verdict="not certified",
    )
    report["digest"] = certify.digest(report)
    assert certify.verify(report) == []
    return report


@pytest.mark.parametrize("plugin", ["rocm", "xpu"])
def test_absent_device_could_not_run(plugin, tmp_path, capsys):
    # in-process: the platform is unavailable, so no suite runs
    assert cli.main(["certify", plugin, "--report", str(tmp_path)]) == 2
    assert "could not run: device absent: " in capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["verdict"] == "could not run" and report["tests"] == []
    assert report["command"]["argv"] == ["vllm-port", "certify", plugin, "--report", str(tmp_path)]
    assert certify.verify(report) == []


def test_unknown_plugin_is_a_clear_error(capsys):
    assert cli.main(["certify", "no-such-chip"]) == 2
    err = capsys.readouterr().err
    assert "unknown plugin 'no-such-chip'" in err and "installed plugins: " in err


def test_plugin_or_verify_is_required(capsys):
    assert cli.main(["certify"]) == 2
    assert "either a PLUGIN" in capsys.readouterr().err


def test_waivers_turn_a_failure_into_waived(tmp_path):
    path = tmp_path / "waivers.toml"
    path.write_text(
        '[[waiver]]\ntest = "test_ops::x"\nreason = "known"\n\n[[waiver]]\ntest = "y"\nplugin = "cuda"\nreason = "r"\n'
    )
    waivers = certify.load_waivers(path, "cpu")
    assert [(w.test, w.reason) for w in waivers] == [("test_ops::x", "known")]
    path.write_text('[[waiver]]\ntest = "test_ops::x"\n')
    with pytest.raises(ValueError, match="reason"):
        certify.load_waivers(path, "cpu")
