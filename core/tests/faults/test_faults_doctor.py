"""``vllm-port doctor`` on broken plugins: each fault caught, the provider marked failed with the reason, and
what serves instead; a slow provider warned about; a hung probe named; strict mode's objections listed."""

from __future__ import annotations

import json

import pytest
from cpu_providers import cpu_provider
from faulty_plugins import adapter
from plugin_factory import healthy

from vllm_port import cli
from vllm_port.doctor import diagnose, render

#: op -> (the fault its zf_ provider has, what doctor says about it)
MIX = {
    "rms_norm": ("raises", "raised RuntimeError: kernel launch failed"),
    "silu_and_mul": ("silu wrong shape", "output: shape ("),
    "gelu_and_mul": ("gelu wrong dtype", "dtype torch.float64, expected"),
    "embedding": ("embedding wrong device", "returned a tensor on meta, but the inputs are on cpu"),
    "linear": ("linear NaN", "got nan"),
    "fused_add_rms_norm": ("wrong in place", "residual:"),
}
#: every test here reads the module's one doctor run (``report``), about 3 CPU s: slow as a whole
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One doctor run over an adapter plugin with a fault in each of six ops and a slow seventh (a few seconds)."""
    import sys

    from plugin_factory import write_plugin

    site = tmp_path_factory.mktemp("site")
    write_plugin(site, "zfaulty", adapter(*(fault for fault, _ in MIX.values()), "rotary slow"))
    sys.path.insert(0, str(site))
    try:
        yield diagnose(plugins="cpu,zfaulty", device="cpu", strict=False)
    finally:
        sys.path.remove(str(site))
        for module in [m for m in sys.modules if m.startswith("vllm_port_test_zfaulty")]:
            del sys.modules[module]


@pytest.mark.parametrize("op", sorted(MIX))
def test_doctor_marks_each_faulty_provider_failed_and_shows_what_serves_instead(report, op):
    info = report["ops"][op]
    assert info["provider"] == cpu_provider(op)  # bfloat16's binding: the next candidate
    assert {f["dtype"] for f in info["failed"]} == {"float32", "bfloat16", "float16"}
    failed = info["failed"][0]
    assert (failed["provider"], failed["plugin"], failed["instead"]) == (f"zf_{op}", "zfaulty", cpu_provider(op))
    assert MIX[op][1] in failed["reason"]
    assert report["smoke"][op].startswith(f"FAIL: zf_{op} (zfaulty) torch.float32: on sample ")
    assert report["smoke"][op].endswith(f"; serves instead: {cpu_provider(op)}")


def test_doctor_warns_about_a_slow_provider_and_keeps_it(report):
    info = report["ops"]["rotary_embedding"]
    assert info["provider"] == "zf_rotary_embedding" and report["smoke"]["rotary_embedding"] == "PASS"
    assert (
        info["slow"]
        and "zf_rotary_embedding (zfaulty)" in info["slow"][0]
        and "where the reference takes" in info["slow"][0]
    )
    assert "VLLM_PORT_OP_PROVIDERS=rotary_embedding=reference" in info["slow"][0]


def test_doctor_text_and_verdict(report):
    assert report["ok"] is False and report["error"] is None
    assert report["memory"]["allocator"] and report["comm"]["served_by"]["collectives"] == "torch.distributed"
    text = render(report)
    assert "! failed: zf_rms_norm (zfaulty) float32: on sample 'small': raised RuntimeError" in text
    assert f"-> {cpu_provider('rms_norm')} serves instead" in text and "! slow: zf_rotary_embedding" in text
    assert "Fallbacks (what vllm-port replaced on its own; strict mode refuses each):" in text
    assert text.endswith("NOT OK")
    assert len(report["strict_problems"]) == len(MIX) * 3  # each failed provider, in each dtype


def test_strict_doctor_names_a_hung_probe_and_exits_1(install_plugin, monkeypatch, capsys):
    install_plugin("zhang", healthy("zhang", priority=99, extra=__import__("test_faults_strict").HANGING_PROBE))
    monkeypatch.setenv("VLLM_PORT_PROBE_TIMEOUT", "0.2")
    assert cli.main(["--strict", "doctor", "--json", "--plugins", "cpu,zhang"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["selected"] == "cpu" and report["strict"] is True
    hung = next(p for p in report["plugins"] if p["name"] == "zhang")
    assert "vllm_port_platform_probe did not answer within the 0.2 s limit" in hung["error"]
    assert report["strict_problems"][0].startswith("plugin 'zhang' (vllm-port-test-zhang 0.0.1) was skipped")
    assert all(v == "PASS" for v in report["smoke"].values())  # not strict, it would be OK
