"""The bridge refuses a vLLM it does not know, or one whose replaced methods changed signature (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_port_vllm import compat
from vllm_port_vllm.errors import BridgeError


def test_an_unknown_version_is_refused_by_name() -> None:
    with pytest.raises(BridgeError, match=r"vLLM 0\.33\.1 is not a version the bridge knows \(it knows 0\.32\)"):
        compat.check_vllm("0.33.1")


def test_a_changed_signature_is_refused_naming_the_method_and_both_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    known = dict(compat.KNOWN["0.32"])
    name = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"
    changed = {**known, name: "(self, x: torch.Tensor, residual=None, scale=None)"}
    monkeypatch.setattr(compat, "signatures", lambda: changed)
    with pytest.raises(
        BridgeError, match=r"RMSNorm\.forward_native\(self, x: torch\.Tensor, residual=None, scale=None\) \(expected"
    ):
        compat.check_vllm("0.32.0")


def test_a_missing_method_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    known = dict(compat.KNOWN["0.32"])
    name = "vllm.v1.attention.backends.utils:split_decodes_and_prefills"
    monkeypatch.setattr(compat, "signatures", lambda: {**known, name: "missing (AttributeError)"})
    with pytest.raises(BridgeError, match=r"split_decodes_and_prefills.*missing \(AttributeError\)"):
        compat.check_vllm("0.32.0+cpu")


def test_the_known_version_with_its_signatures_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "signatures", lambda: dict(compat.KNOWN["0.32"]))
    assert compat.check_vllm("0.32.0+cpu") == "0.32"
