"""Providers that misbehave at run time, each in a real installed plugin: what binding, blame and debug mode do."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from cpu_providers import cpu_provider

from vllm_port import cli
from vllm_port.errors import OpInputError, ProviderError, StrictModeError
from vllm_port.ops import rms_norm
from vllm_port.ops.debug import CheckConfig, blame, check_config, load_repro, quarantined

#: fault -> what the smoke check says about it (on the op's own samples)
SAID = {
    "raises": "raised RuntimeError: kernel launch failed",
    "wrong shape": "output: shape (",
    "wrong dtype": "dtype torch.float64, expected torch.float32",
    "wrong device": "returned a tensor on meta, but the inputs are on cpu",
    "NaN": "got nan, expected",
    "wrong values": "elements off",
}
#: what debug mode says, on the inputs of this file
SAID_AT_RUN = {
    **SAID,
    "wrong shape": "returned shape (3, 31), expected (3, 32)",
    "NaN": "1 of 96 elements off the reference beyond the tolerance (atol=1e-05, rtol=1e-05); max abs error inf",
    "wrong values": "disagrees with the float64 reference on its call 1: output: ",
}


def inputs(rows: int = 3, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(rows, 32, generator=gen, dtype=dtype), torch.randn(32, generator=gen, dtype=dtype)


@pytest.mark.parametrize("fault", sorted(SAID))
def test_verify_skips_a_faulty_provider_for_the_next_candidate_and_strict_refuses(faulty_runtime, fault):
    runtime = faulty_runtime(fault)
    kernels = runtime.bind(torch.float32, verify=True, check=False)
    assert kernels.providers["rms_norm"].name == cpu_provider("rms_norm")
    ((bad, why),) = kernels.skipped["rms_norm"]
    assert (bad.name, bad.plugin) == ("zf_rms_norm", "zfaulty")
    assert why.startswith("on sample 'small': ") and SAID[fault] in why
    assert (
        "op 'rms_norm'" in kernels.fallbacks[0] and "provider 'zf_rms_norm' of plugin 'zfaulty'" in kernels.fallbacks[0]
    )
    with pytest.raises(StrictModeError, match=r"strict mode .* refuses a fallback: op 'rms_norm' .*zf_rms_norm"):
        runtime.bind(torch.float32, verify=True, check=False, strict=True)


def test_without_debug_mode_a_bound_op_is_the_bare_provider_and_blame_names_it(faulty_runtime):
    runtime = faulty_runtime("raises")
    kernels = runtime.bind(torch.float32)
    assert kernels.rms_norm is kernels.providers["rms_norm"].fn  # the hot path is unchanged
    x, w = inputs()
    with pytest.raises(ProviderError) as caught, blame(kernels):
        kernels.rms_norm(x, w, 1e-6)
    message = str(caught.value)
    assert (
        "op 'rms_norm': provider 'zf_rms_norm' of plugin 'zfaulty' raised RuntimeError: kernel launch failed" in message
    )
    assert (
        f"VLLM_PORT_OP_PROVIDERS=rms_norm={cpu_provider('rms_norm')}" in message
        and "VLLM_PORT_PLUGINS=-zfaulty" in message
    )
    assert (caught.value.op, caught.value.provider, caught.value.plugin) == ("rms_norm", "zf_rms_norm", "zfaulty")
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_blame_leaves_bad_inputs_and_foreign_errors_alone(faulty_runtime):
    kernels = faulty_runtime("wrong values").bind(torch.float32)
    x, w = inputs()
    with pytest.raises(OpInputError) as caught, blame(kernels):
        kernels.rms_norm(x, w.to(torch.float16), 1e-6)  # the reference's input check refuses, inside the provider
    assert any("refused by provider 'zf_rms_norm' of plugin 'zfaulty'" in n for n in caught.value.__notes__)
    with pytest.raises(KeyError), blame(kernels):
        raise KeyError("not a provider's")


@pytest.mark.parametrize("fault", sorted(SAID))
def test_debug_mode_quarantines_at_the_first_fault_and_answers_with_the_next_candidate(
    faulty_runtime, fault, tmp_path, caplog
):
    runtime = faulty_runtime(fault)
    kernels = runtime.bind(torch.float32, check=CheckConfig(rate=0.01, directory=tmp_path))
    bad = kernels.providers["rms_norm"]
    assert bad.name == "zf_rms_norm"
    x, w = inputs()
    with caplog.at_level(logging.WARNING, logger="vllm_port.check"):
        got = kernels.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, rms_norm.reference(x, w, 1e-6))  # the call itself was answered right
    assert kernels.providers["rms_norm"].name == cpu_provider("rms_norm")
    assert SAID_AT_RUN[fault] in quarantined(bad)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "op 'rms_norm': provider 'zf_rms_norm' of plugin 'zfaulty'" in warning and "Quarantined" in warning
    assert (
        f"'{cpu_provider('rms_norm')}' serves op 'rms_norm' instead" in warning and "vllm-port check-repro" in warning
    )
    (repro,) = tmp_path.glob("*.json")
    record = json.loads(repro.read_text())
    assert (record["op"], record["provider"], record["plugin"], record["dtype"]) == (
        "rms_norm",
        "zf_rms_norm",
        "zfaulty",
        "float32",
    )
    assert record["command"] == f"vllm-port check-repro {repro}"
    # later binds in this process skip the quarantined provider, and say why
    later = runtime.bind(torch.float32, check=False)
    assert later.providers["rms_norm"].name == cpu_provider("rms_norm")
    assert "op 'rms_norm'" in later.skipped["rms_norm"][0][1]


def test_debug_mode_checks_every_calls_metadata_and_samples_values(faulty_runtime, tmp_path):
    runtime = faulty_runtime("wrong shape later")
    kernels = runtime.bind(torch.float32, check=CheckConfig(rate=1e-9, directory=tmp_path))
    x, w = inputs(rows=1)
    kernels.rms_norm(x, w, 1e-6)  # the first call is compared with the reference, and agrees
    assert kernels.rms_norm.compared == 1 and kernels.providers["rms_norm"].name == "zf_rms_norm"
    x, w = inputs(rows=4)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), rms_norm.reference(x, w, 1e-6))
    assert kernels.providers["rms_norm"].name == cpu_provider("rms_norm")  # a call not compared, caught by its shape
    assert "returned shape (3, 32), expected (4, 32)" in kernels.fallbacks[-1]


def test_debug_mode_restores_in_place_arguments_before_the_next_candidate_runs(faulty_runtime, tmp_path):
    from vllm_port.ops import fused_add_rms_norm

    kernels = faulty_runtime("wrong in place").bind(torch.float32, check=CheckConfig(rate=0.01, directory=tmp_path))
    x, w = inputs()
    residual = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    want_residual = residual.clone()
    want = fused_add_rms_norm.reference(x, want_residual, w, 1e-6)
    got = kernels.fused_add_rms_norm(x, residual, w, 1e-6)
    assert kernels.providers["fused_add_rms_norm"].name == cpu_provider("fused_add_rms_norm")
    assert "residual (written in place)" in kernels.fallbacks[0]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(residual, want_residual)  # added once, by the provider that served the call


def test_strict_debug_mode_stops_with_the_reproducer_instead_of_quarantining(faulty_runtime, tmp_path, monkeypatch):
    kernels = faulty_runtime("wrong values").bind(torch.float32, check=CheckConfig(rate=0.01, directory=tmp_path))
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    x, w = inputs()
    with pytest.raises(ProviderError, match=r"Strict mode \(VLLM_PORT_STRICT=1\) forbids.*Reproducer: .*\.json"):
        kernels.rms_norm(x, w, 1e-6)
    assert kernels.providers["rms_norm"].name == "zf_rms_norm"


def test_which_calls_debug_mode_compares_follows_the_seed(faulty_runtime, tmp_path, monkeypatch):
    import vllm_port.ops._checked as checked  # where CheckedOp looks the comparison up

    compared: list[int] = []
    monkeypatch.setattr(checked, "compare_with_reference", lambda *args: compared.append(len(compared)) or None)
    runtime = faulty_runtime("slow")
    x, w = inputs()

    def calls_compared(seed: int) -> list[int]:
        kernels = runtime.bind(torch.float32, check=CheckConfig(rate=0.25, seed=seed, directory=tmp_path))
        kernels.providers["rms_norm"] = runtime.bind(torch.float32, check=False).providers["rms_norm"]
        checked = kernels.rms_norm
        checked.provider = checked.candidates[1]  # the CPU plugin's: no sleeping
        picked = []
        for i in range(80):
            before = checked.compared
            checked(x, w, 1e-6)
            if checked.compared > before:
                picked.append(i)
        return picked

    first, again, other = calls_compared(7), calls_compared(7), calls_compared(8)
    assert first == again and first != other
    assert first[0] == 0 and 8 <= len(first) <= 35  # the first call, then about a quarter


def test_check_setting_is_parsed_and_refused_when_not_a_share(monkeypatch, tmp_path):
    from vllm_port.errors import SelectionError

    assert check_config("0") is None and check_config("") is None
    assert check_config("on").rate == 0.01 and check_config("1").rate == 1.0
    monkeypatch.setenv("VLLM_PORT_CHECK_SEED", "5")
    monkeypatch.setenv("VLLM_PORT_CHECK_DIR", str(tmp_path))
    assert check_config("0.5") == CheckConfig(0.5, 5, tmp_path)
    for bad in ("2", "-0.1", "often"):
        with pytest.raises(SelectionError, match=f"VLLM_PORT_CHECK='{bad}' is not a share of calls"):
            check_config(bad)


def test_a_reproducer_replays_with_the_inputs_layout_and_says_whether_it_reproduces(
    faulty_runtime, tmp_path, monkeypatch, capsys
):
    runtime = faulty_runtime("wrong values")
    kernels = runtime.bind(torch.float32, check=CheckConfig(rate=0.01, directory=tmp_path))
    wide = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    x, w = wide[:, ::2], torch.randn(32)  # a strided view, as a slice of a fused projection is
    kernels.rms_norm(x, w, 1e-6)
    (repro,) = tmp_path.glob("*.json")
    _, args = load_repro(repro, torch.device("cpu"))
    assert args[0].stride() == x.stride() and torch.equal(args[0], x) and args[2] == 1e-6
    monkeypatch.setenv("VLLM_PORT_PLUGINS", "cpu,zfaulty")
    assert cli.main(["check-repro", str(repro)]) == 1
    out = capsys.readouterr().out
    assert "reproduced (op 'rms_norm', 'zf_rms_norm' of plugin 'zfaulty', float32 on 'cpu')" in out
    assert cli.main(["check-repro", str(repro), "--provider", "cpu_rms_norm"]) == 0
    assert "not reproduced" in capsys.readouterr().out
    assert cli.main(["check-repro", str(tmp_path / "missing.json")]) == 2
