"""``VLLM_BRIDGE_KEEP`` names the parts left to vLLM's kernels, and nothing it does not know (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_port_vllm.errors import BridgeError
from vllm_port_vllm.keep import KEEP_ENV, PARTS, kept_parts


def test_unset_or_empty_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEEP_ENV, raising=False)
    assert kept_parts() == frozenset()
    assert kept_parts(" , ") == frozenset()


def test_named_parts_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEEP_ENV, "attention, RMSNorm")
    assert kept_parts() == {"attention", "RMSNorm"}
    assert kept_parts(",".join(PARTS)) == set(PARTS)


def test_an_unknown_part_is_refused_listing_the_known_ones() -> None:
    with pytest.raises(BridgeError, match=r"'rmsnorm', which the bridge does not route; .*RMSNorm, SiluAndMul"):
        kept_parts("attention,rmsnorm")
