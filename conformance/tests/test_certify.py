"""``vllm-port certify``: the verdict, the report, ``--verify`` and partial runs (``--check``).

The tests that read the CPU plugin's report share one whole-suite certification per pytest run
(``cpu_certified``, in conftest.py), as those that read alpha's share one; under pytest-xdist each
is made once for all workers, and ``xdist_group`` keeps its readers together.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from certify_helpers import Certified, CertifyJob, run_certify, run_certify_batch, write_plugin
from shared_runs import CPU_CERTIFICATION, OncePerRun

from vllm_port import cli
from vllm_port_conformance import certify, inside_vllm
from vllm_port_conformance.comm_ranks import MULTI_RANK_CHECKS

#: the shared run (and xdist group) of alpha's certification for one device
ALPHA = "certify-alpha-1-device"


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
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


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_verify_accepts_the_untouched_report(cpu_certified, capsys):
    assert cli.main(["certify", "--verify", str(cpu_certified.report_dir / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "report verified: cpu: certified" in out
    assert "source: the same as the packages installed here" in out


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_the_report_carries_a_digest_of_the_sources_it_ran(cpu_certified):
    from vllm_port.discovery import discover

    source = cpu_certified.report["source"]
    assert source["packages"] == ["vllm_port", "vllm_port_conformance", "vllm_port_cpu"]
    assert {"vllm-port", "vllm-port-conformance", "vllm-port-cpu"} <= set(source["distributions"])
    assert source["files"] > 50
    assert source == certify.source_digest(certify.run_packages("cpu", discover(plugins="cpu")), ["vllm-port-cpu"])
    other = certify.source_digest(["vllm_port", "vllm_port_conformance", "vllm_port_cuda"])
    assert other["sha256"] != source["sha256"]  # another plugin's package instead


def test_the_source_digest_covers_every_file_of_a_package_but_bytecode(tmp_path, monkeypatch):
    """A native source or a data file changes what ran as surely as Python does; bytecode does not."""
    package = tmp_path / "chipkernels"
    (package / "csrc").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "csrc" / "kernel.c").write_text("int add(int a, int b) { return a + b; }\n")
    (package / "configs.json").write_text("{}")
    monkeypatch.syspath_prepend(str(tmp_path))
    first = certify.source_digest(["chipkernels"])
    assert first["packages"] == ["chipkernels"] and first["files"] == 3

    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"bytecode")
    (package / "csrc" / "kernel.pyc").write_bytes(b"bytecode")
    assert certify.source_digest(["chipkernels"]) == first

    for edited in ("csrc/kernel.c", "configs.json"):
        before = (package / edited).read_text()
        (package / edited).write_text(before + " ")
        assert certify.source_digest(["chipkernels"])["sha256"] != first["sha256"], f"{edited} is outside the digest"
        (package / edited).write_text(before)
    assert certify.source_digest(["chipkernels"]) == first


def test_verify_says_an_older_reports_source_digest_cannot_be_compared(tmp_path, capsys):
    report = _certified_report()
    report.update(report_version=6, source={"packages": ["vllm_port"], "distributions": [], "files": 1, "sha256": "0"})
    report["digest"] = certify.digest(report)
    code, out = _verify(tmp_path, report, capsys)
    assert code == 0 and "report verified" in out
    assert "source: not comparable: report version 6 hashed only the packages' .py files" in out
    assert "certify again" in out


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_a_full_scope_report_and_the_first_probe(cpu_certified):
    report = cpu_certified.report
    assert report["report_version"] == certify.REPORT_VERSION == 7
    assert report["selection"] is None  # the whole suite ran
    assert report["scope"] == {
        "devices": 1,
        "devices_found": 1,
        "devices_requested": None,
        "comm_ranks": 2,  # the host's ranks share it: the multi-rank checks run
        "full": True,
        "label": "full",
    }
    assert report["summary"]["out_of_scope"] == 0 and certify.headline(report) == "certified"
    probe = report["probe"]
    assert 0 <= probe["first_probe_s"] < probe["limit_s"] and "fresh process" in probe["measured_in"]
    assert "Scope: full: 1 device(s) in scope" in (cpu_certified.report_dir / "report.md").read_text()


def test_the_commit_the_runner_names_wins_over_the_checkout(monkeypatch):
    monkeypatch.delenv(certify.COMMIT_ENV, raising=False)
    here = certify._git()
    assert "from" not in here
    monkeypatch.setenv(certify.COMMIT_ENV, "0123abc")
    got = certify._git()
    assert got["commit"] == "0123abc" and got["dirty"] == "unknown" and certify.COMMIT_ENV in got["from"]


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_the_report_names_the_plugins_own_commit(cpu_certified, tmp_path, capsys):
    about = cpu_certified.report["plugin"]
    assert about["distribution"] == "vllm-port-cpu" and about["version"]
    assert about["git"]["commit"] == certify._git()["commit"]  # the in-tree plugin: this checkout
    assert "the checkout of" in about["git"]["from"] and "plugins/vllm-port-cpu" in about["git"]["from"]
    assert "| vllm-port-cpu commit |" in (cpu_certified.report_dir / "report.md").read_text()
    status, out = _verify(tmp_path, cpu_certified.report, capsys)
    assert status == 0 and "plugin: vllm-port-cpu" in out


def test_the_plugin_commit_comes_from_its_own_checkout_or_the_runner(tmp_path, monkeypatch):
    monkeypatch.delenv(certify.PLUGIN_COMMIT_ENV, raising=False)
    repo = tmp_path / "vendor"
    repo.mkdir()
    module = write_plugin(repo, "vendorchip", "from vllm_port import hookimpl\n")
    git = ["git", "-c", "user.email=v@example.com", "-c", "user.name=v", "-C", str(repo)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "vendor"]):
        subprocess.run([*git, *args], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    monkeypatch.syspath_prepend(str(repo))
    try:
        got = certify.plugin_git("vendorchip")
        assert got == {"commit": commit, "dirty": False, "from": f"the checkout of {repo.resolve()}"}
        (repo / f"{module}.py").write_text("# edited\n")
        assert certify.plugin_git("vendorchip")["dirty"] is True
        monkeypatch.setenv(certify.PLUGIN_COMMIT_ENV, "feedbeef")
        assert certify.plugin_git("vendorchip")["commit"] == "feedbeef"
    finally:
        sys.modules.pop(module, None)


def test_a_copy_inside_another_repository_is_not_given_its_commit(tmp_path, monkeypatch):
    # an installed copy lying in a vendor's .tox/ (untracked) must not take the vendor's commit
    monkeypatch.delenv(certify.PLUGIN_COMMIT_ENV, raising=False)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    site = tmp_path / ".tox" / "site"
    site.mkdir(parents=True)
    module = write_plugin(site, "untracked", "from vllm_port import hookimpl\n")
    monkeypatch.syspath_prepend(str(site))
    try:
        got = certify.plugin_git("untracked")
        assert got["commit"] == "unknown" and certify.PLUGIN_COMMIT_ENV in got["from"]
    finally:
        sys.modules.pop(module, None)


def test_verify_wants_the_plugin_commit_from_version_4_on():
    report = _minimal_failed()
    report["report_version"], report["plugin"] = 4, {"name": "x", "distribution": "x", "version": "1"}
    report["digest"] = certify.digest(report)
    assert certify.verify(report) == ["missing key 'plugin.git'"]
    report["report_version"] = 3  # older reports hold without it
    report["digest"] = certify.digest(report)
    assert certify.verify(report) == []


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_verify_rejects_an_edited_field(cpu_certified, tmp_path, capsys):
    report = cpu_certified.report
    report["device"]["devices"][0]["name"] = "NVIDIA H200"
    status, out = _verify(tmp_path, report, capsys)
    assert status == 1
    assert "report rejected" in out and "digest mismatch" in out and "edited" in out


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
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
    report = {k: None for k in certify.REQUIRED_KEYS + certify.REQUIRED_KEYS_V3}
    report.update(
        report_version=3,
        tests=tests,
        summary=certify._summary(tests),
        device={"available": True, "reason": "here", "device_type": "cpu", "devices": [{"name": "host"}]},
        scope=certify.scope_of("cpu", 1, None),
        verdict="not certified",
    )
    report["digest"] = certify.digest(report)
    assert certify.verify(report) == []
    return report


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_without_vllm_the_report_says_the_stage_inside_vllm_did_not_run_and_why(cpu_certified):
    report = cpu_certified.report
    assert report["vllm"] == {"ran": False, "why": "vLLM is not installed beside the plugin"}
    assert "vllm_port_vllm" not in report["source"]["packages"]  # the bridge ran nothing here
    md = (cpu_certified.report_dir / "report.md").read_text()
    assert "## Inside vLLM\n\nNot run: vLLM is not installed beside the plugin." in md


def test_vllm_require_without_vllm_is_an_error_before_the_suite_runs(capsys):
    assert cli.main(["certify", "cpu", "--vllm", "require"]) == 2
    err = capsys.readouterr().err
    assert "--vllm require: vLLM is not installed beside the plugin" in err and "--vllm auto or skip" in err


def _certified_report():
    tests = [{"id": "test_ops::x", "state": "passed", "duration_s": 0.1, "message": ""}]
    report = _minimal_failed()
    report.update(
        report_version=7,
        tests=tests,
        summary=certify._summary(tests),
        selection=None,
        vllm=inside_vllm.not_run(inside_vllm.UNDER_WAY),
        verdict="certified",
        reason="all 1 checks passed or waived",
        timing={"started": "now", "total_s": 1.0},
        plugin={"name": "cpu", "distribution": "vllm-port-cpu", "version": "0.1.0", "git": {}},
    )
    report["digest"] = certify.digest(report)
    assert certify.verify(report) == []
    return report


#: what ``python -m vllm_port_vllm.check --json`` answers for a plugin whose rotary is off inside vLLM
_FAILED_INSIDE_VLLM = {
    "ok": False,
    "model": "tiny-llama",
    "vllm_version": "0.32.0",
    "dtype": "float32",
    "atol": 1e-5,
    "rtol": 1e-5,
    "modes": {
        "eager": {
            "ok": False,
            "worst_prefill": 3.5,
            "worst_decode": 0.2,
            "requests": 4,
            "equal_requests": 3,
            "divergences": [{"request": 1, "step": 2, "alone": 7, "bridged": 9, "gap": 0.5, "tie_bound": 1e-4, "tie": False}],
            "calls": {"rotary_embedding": 0, "rms_norm": 12},
            "uncalled": ["rotary_embedding"],
        },
        "compiled": {"ok": True, "worst_prefill": 0.1, "worst_decode": 0.1, "requests": 4, "equal_requests": 4,
                     "divergences": [], "calls": {"rotary_embedding": 8, "rms_norm": 12}, "uncalled": []},
    },
}  # fmt: skip


def test_a_failure_inside_vllm_refuses_a_plugin_the_suite_passed(monkeypatch):
    """The stage hands the bridge the suite's own certificate, and its failure makes the final report refuse."""
    handed = []

    def check(plugin, certificate):
        handed.append((plugin, json.loads(certificate.read_text())))
        return {"ran": True, **_FAILED_INSIDE_VLLM}

    monkeypatch.setattr(inside_vllm, "run", check)
    suite = _certified_report()
    final = certify._inside_vllm(suite, "cpu", suite["device"], suite["tests"], suite["scope"], 0.0)
    assert handed == [("cpu", suite)]  # a certificate of the suite's run, saying the stage is under way
    assert final["verdict"] == "not certified" and final["vllm"]["ran"] and not final["vllm"]["ok"]
    reason = final["reason"]
    assert reason.startswith(
        "the suite passed, but inside vLLM (the bridge against vLLM alone): tiny-llama eager: logprobs 3.5x"
    )
    assert "request 1 first differs at step 2" in reason and "bridged ops never called: rotary_embedding" in reason
    assert "compiled" not in reason and final["timing"]["vllm_s"] >= 0
    assert certify.verify(final) == []
    assert "| eager | 3.5, 0.2 | 3/4 | request 1 step 2 gap 0.5 |" in "\n".join(certify._vllm_lines(final["vllm"]))


def test_a_mixture_of_experts_failing_inside_vllm_refuses_naming_it():
    """The dense model passed; the mixture of experts (``vllm.moe``) did not: refused, naming the model and its op."""
    moe = copy.deepcopy(_FAILED_INSIDE_VLLM)
    moe["model"] = "tiny-mixtral"
    moe["modes"]["eager"].update(worst_prefill=0.1, divergences=[], calls={"fused_moe": 0}, uncalled=["fused_moe"])
    dense = copy.deepcopy(_FAILED_INSIDE_VLLM["modes"]["compiled"])
    stage = {"ran": True, **_FAILED_INSIDE_VLLM, "ok": False, "modes": {"eager": dense, "compiled": dense}, "moe": moe}
    assert inside_vllm.failure(stage) == "tiny-mixtral eager: bridged ops never called: fused_moe"
    assert inside_vllm.failure({**stage, "ok": True}) is None
    lines = "\n".join(certify._vllm_lines(stage))
    assert "a mixture of experts (tiny-mixtral)" in lines and "| eager | 0.1, 0.2 | 3/4 | none | fused_moe 0 |" in lines


def test_verify_rejects_a_certified_verdict_over_a_failure_inside_vllm():
    report = _certified_report()
    report["vllm"] = {"ran": True, **_FAILED_INSIDE_VLLM}
    report["digest"] = certify.digest(report)
    assert any("inconsistent" in p for p in certify.verify(report))
    report["vllm"] = {"ran": True, "ok": False, "error": "the check inside vLLM exited 1: BridgeError"}
    report["digest"] = certify.digest(report)
    assert any("inconsistent" in p for p in certify.verify(report))


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


# -------------------------------------------------------------------------------------------------
# Scope: certified for one device; the source digest of every distribution that ran
# -------------------------------------------------------------------------------------------------

#: A second distribution: a plugin that brings a kernel (and offers it to platform "alpha" itself).
BETA = """
import torch

from vllm_port import hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.activation import check_silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = check_silu_and_mul(x)
    return (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_providers():
    return [Provider("silu_and_mul", "beta_silu_and_mul", silu_and_mul, dtypes=frozenset({torch.float32}), platform="alpha")]
"""

#: A one-device platform whose provider is beta's kernel.
ALPHA_PLATFORM = """
import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from {beta} import silu_and_mul


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="alpha", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "one test device", (DeviceInfo("test device", 1 << 34, "test"),))


@hookimpl
def vllm_port_providers():
    return [Provider("silu_and_mul", "beta_silu_and_mul", silu_and_mul, dtypes=frozenset({{torch.float32}}))]
"""


@pytest.fixture(scope="session")
def alpha_for_one_device(once: OncePerRun) -> Certified:
    """``certify alpha --devices 1``: a world of one on a platform whose kernel is another distribution's."""

    def run(folder):
        site = folder / "site"
        site.mkdir()
        beta = write_plugin(site, "beta", BETA)
        write_plugin(site, "alpha", ALPHA_PLATFORM.format(beta=beta))
        return run_certify("alpha", "--devices", "1", site=site, report_dir=folder / "alpha")

    return once(ALPHA, run)


@pytest.mark.slow
@pytest.mark.xdist_group(ALPHA)
def test_one_device_is_certified_for_1_device_with_the_multi_device_checks_out_of_scope(alpha_for_one_device):
    run = alpha_for_one_device
    assert run.returncode == 0, run.output
    assert "alpha: certified for 1 device" in run.stdout
    report = run.report
    assert report["verdict"] == "certified" and certify.headline(report) == "certified for 1 device"
    assert report["scope"]["devices"] == 1 and report["scope"]["comm_ranks"] == 1 and not report["scope"]["full"]
    scoped = sorted(t["id"] for t in report["tests"] if t["state"] == "out_of_scope")
    assert scoped == sorted(f"test_comm::test_comm[{check}]" for check in MULTI_RANK_CHECKS)  # p2p_ring, p2p[dtype]...
    assert report["summary"]["out_of_scope"] == len(MULTI_RANK_CHECKS) and report["summary"]["skipped"] == 0
    ran = {t["id"]: t["state"] for t in report["tests"]}
    assert ran["test_comm::test_comm[all_reduce[float32]]"] == ran["test_comm::test_comm[tp_mlp]"] == "passed"
    assert f"{len(MULTI_RANK_CHECKS)} multi-device checks out of scope: certified for 1 device" in report["reason"]
    md = (run.report_dir / "report.md").read_text()
    assert "**Verdict: certified for 1 device**" in md and "Scope: 1 device: 1 device(s) in scope" in md
    assert report["command"]["argv"][-2:] == ["--devices", "1"]
    assert report["command"]["suite"][-2:] == ["--vllm-port-devices", "1"]
    assert certify.verify(report) == []


@pytest.mark.slow
@pytest.mark.xdist_group(ALPHA)
def test_the_digest_covers_the_distribution_whose_kernel_ran(alpha_for_one_device):
    source = alpha_for_one_device.report["source"]
    beta = [p for p in source["packages"] if p.startswith("vllm_port_test_beta_")]
    alpha = [p for p in source["packages"] if p.startswith("vllm_port_test_alpha_")]
    assert beta and alpha, source
    assert {"vllm-port-test-alpha", "vllm-port", "vllm-port-conformance"} <= set(source["distributions"])


@pytest.mark.slow
@pytest.mark.xdist_group(ALPHA)
def test_verify_understands_the_scope(alpha_for_one_device, tmp_path, capsys):
    report = alpha_for_one_device.report
    status, out = _verify(tmp_path, report, capsys)
    assert status == 0 and "report verified: alpha: certified for 1 device" in out
    assert "scope: 1 device (1 device(s), comm checks on 1 rank(s))" in out
    forged = json.loads(json.dumps(report))
    forged["scope"].update(devices=2, devices_requested=None, comm_ranks=2, full=True, label="full")
    forged["digest"] = certify.digest(forged)
    problems = certify.verify(forged)
    assert any("does not follow from the 1 device(s)" in p for p in problems), problems
    assert any("inconsistent" in p for p in problems), problems  # out-of-scope checks in a full report


def _with(tests, scope_full=False, **device):
    report = {k: None for k in certify.REQUIRED_KEYS + certify.REQUIRED_KEYS_V3}
    scope = certify.scope_of("cuda", 1, None)
    assert scope["full"] is False and scope["label"] == "1 device"
    report.update(
        report_version=3,
        tests=tests,
        summary=certify._summary(tests),
        device={"available": True, "reason": "here", "device_type": "cuda", "devices": [{"name": "gpu"}], **device},
        scope=scope,
    )
    report["verdict"], report["reason"] = certify._verdict(report["device"], tests, scope)
    report["digest"] = certify.digest(report)
    return report


def _t(test_id, state):
    return {"id": test_id, "state": state, "duration_s": 0.0, "message": ""}


def test_only_multi_device_checks_may_be_out_of_scope_and_other_skips_still_refuse():
    base = [_t("test_ops::x", "passed"), _t("test_comm::test_comm[p2p_ring]", "out_of_scope")]
    assert _with(base)["verdict"] == "certified"
    assert certify.verify(_with(base)) == []
    assert _with([*base, _t("test_memory::y", "skipped")])["verdict"] == "not certified"
    assert _with([*base, _t("test_ops::z", "out_of_scope")])["verdict"] == "not certified"  # not a comm check
    full = _with(base)
    full["scope"] = certify.scope_of("cuda", 2, None)
    assert certify._verdict(full["device"], base, full["scope"])[0] == "not certified"  # nothing is out of a full scope
    broken = _with(base, error="plugin 'x': vllm_port_platform_probe did not answer within the 5 s limit")
    assert broken["verdict"] == "not certified" and "did not load" in broken["reason"]
    with pytest.raises(ValueError, match="found only 1"):
        certify.scope_of("cuda", 1, 2)


# -------------------------------------------------------------------------------------------------
# Partial runs: --check runs only the checks it names, through the same suite, and never certifies
# -------------------------------------------------------------------------------------------------

PARTIAL = "certify-cpu-partial"
#: a module and one check of another: what the partial run must hold and nothing else
SELECTED = ("test_platform::", "test_memory::test_double_free_is_refused")


@pytest.fixture(scope="session")
def cpu_partial(once: OncePerRun) -> dict[str, Certified]:
    """``certify cpu --check ...`` twice, in one process: ``ran`` (the checks of ``SELECTED``), ``unmatched`` (a typo)."""

    def run(folder):
        selected = tuple(arg for check in SELECTED for arg in ("--check", check))
        jobs = [
            CertifyJob("cpu", selected, folder / "ran"),
            CertifyJob("cpu", ("--check", "test_platform::test_no_such_check"), folder / "unmatched"),
        ]
        ran, unmatched = run_certify_batch(jobs, folder)
        return {"ran": ran, "unmatched": unmatched}

    return once(PARTIAL, run)


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_a_partial_run_holds_the_selected_checks_as_the_whole_suite_runs_them(cpu_partial, cpu_certified):
    run = cpu_partial["ran"]
    assert run.returncode == 1, run.output
    assert "cpu: not certified" in run.stdout
    report = run.report
    assert report["selection"] == list(SELECTED)
    checks = ["--check", SELECTED[0], "--check", SELECTED[1]]
    assert report["command"]["argv"] == ["vllm-port", "certify", "cpu", "--report", str(run.report_dir), *checks]
    assert report["command"]["suite"][-2:] == [f"--vllm-port-check={SELECTED[0]}", f"--vllm-port-check={SELECTED[1]}"]
    whole = {t["id"]: t["state"] for t in cpu_certified.report["tests"]}
    want = {test: state for test, state in whole.items() if any(s in test for s in SELECTED)}
    assert len(want) > 2 and {t["id"]: t["state"] for t in report["tests"]} == want  # the same checks, the same states
    # its progress, on stderr (not a terminal here: lines, the last one the whole run)
    assert f"certify cpu: {len(want)}/{len(want)} checks (100%)" in run.stderr and "checks (" not in run.stdout
    assert (
        report["verdict"] == "not certified"
        and "a partial run" in report["reason"]
        and "certify without --check" in report["reason"]
    )
    assert "Partial run (`--check`), not a certificate" in (run.report_dir / "report.md").read_text()
    assert certify.verify(report) == []
    forged = json.loads(json.dumps(report))
    forged["verdict"] = "certified"
    forged["digest"] = certify.digest(forged)
    assert any("inconsistent" in p for p in certify.verify(forged))  # a partial run is never a certificate
    del forged["selection"]
    forged["digest"] = certify.digest(forged)
    assert "missing key 'selection'" in certify.verify(forged)


@pytest.mark.slow
@pytest.mark.xdist_group(CPU_CERTIFICATION)
def test_a_check_that_selects_nothing_is_a_clear_error(cpu_partial):
    run = cpu_partial["unmatched"]
    assert run.returncode == 2, run.output
    assert "error: --check 'test_platform::test_no_such_check' selects none of the" in run.stderr
    assert "plugin 'cpu'" in run.stderr and "as report.json lists it" in run.stderr
    assert not (run.report_dir / "report.json").exists()


def test_a_partial_run_is_refused_by_its_failures_and_never_certified():
    passed = [_t("test_ops::x", "passed"), _t("test_memory::y", "passed")]
    verdict, reason = certify._verdict(_with(passed)["device"], passed, certify.scope_of("cpu", 1, None), ["test_"])
    assert verdict == "not certified" and "a partial run: the 2 checks selected by --check passed" in reason
    failed = [*passed, _t("test_memory::z", "failed")]
    verdict, reason = certify._verdict(_with(failed)["device"], failed, certify.scope_of("cpu", 1, None), ["test_"])
    assert verdict == "not certified" and reason.startswith("1 failed")
    assert certify._verdict(_with(passed)["device"], passed, certify.scope_of("cpu", 1, None))[0] == "certified"


def test_a_check_may_start_with_a_dash():
    # "-my_rms_norm-": every check of one provider; argparse alone would read it as an unknown option
    argv = cli.join_dash_values(["certify", "mychip", "--check", "-my_rms_norm-", "--check", "test_memory::"])
    assert argv == ["certify", "mychip", "--check=-my_rms_norm-", "--check", "test_memory::"]
    assert cli.build_parser().parse_args(argv).check == ["-my_rms_norm-", "test_memory::"]
