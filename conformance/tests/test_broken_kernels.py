"""The suite catches wrong kernels: certify a real plugin whose providers are broken on purpose.

Each broken provider fails in one way a real kernel does; certification must refuse the plugin and
each failure must name the plugin, provider, op, dtype and the sample case to replay.
"""

from __future__ import annotations

import pytest
from certify_helpers import run_certify, write_plugin

BROKEN = """
import torch

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.ops import Provider
from vllm_port.ops.activation import silu_and_mul_reference
from vllm_port.ops.attention import paged_attention_reference, reshape_and_cache_reference
from vllm_port.ops.norm import rms_norm_reference


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name="broken", device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "a test device that is always there", (DeviceInfo("test device", 1 << 30, "test"),))


def eps_ignored(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, 1e-6)  # the caller's epsilon never reaches the kernel


def nan_at_256(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    out = rms_norm_reference(x, weight, epsilon)
    return torch.full_like(out, float("nan")) if x.shape[-1] == 256 else out


def drops_last_token(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    # off by one at a block boundary: a sequence one token into a new block loses that token
    lens = torch.where((seq_lens % key_cache.shape[1] == 1) & (seq_lens > 1), seq_lens - 1, seq_lens)
    return paged_attention_reference(query, key_cache, value_cache, block_tables, lens, scale, sliding_window, soft_cap)


def float32_out(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_reference(x.float())  # forgets to cast back to the input dtype


def skips_last(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    reshape_and_cache_reference(key[:-1], value[:-1], key_cache, value_cache, slot_mapping[:-1])


@hookimpl
def vllm_port_providers():
    bf16 = frozenset({torch.bfloat16})
    return [
        Provider("rms_norm", "eps_ignored_rms_norm", eps_ignored, dtypes=bf16),
        Provider("rms_norm", "nan_rms_norm", nan_at_256, dtypes=bf16),
        Provider("paged_attention", "off_by_one_paged_attention", drops_last_token, dtypes=bf16),
        Provider("silu_and_mul", "fp32_silu_and_mul", float32_out, dtypes=bf16),
        Provider("reshape_and_cache", "lossy_reshape_and_cache", skips_last, dtypes=bf16),
    ]
"""

#: provider -> (op, the sample case its failure must name)
EXPECTED = {
    "eps_ignored_rms_norm": ("rms_norm", "epsilon dominates"),
    "nan_rms_norm": ("rms_norm", "one token"),
    "off_by_one_paged_attention": ("paged_attention", "block boundaries, gqa 1"),
    "fp32_silu_and_mul": ("silu_and_mul", "small"),
    "lossy_reshape_and_cache": ("reshape_and_cache", "small"),
}


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    write_plugin(site, "broken", BROKEN)
    return run_certify("broken", site=site, report_dir=tmp_path_factory.mktemp("report") / "broken")


def test_broken_plugin_is_not_certified(broken):
    assert broken.returncode == 1, broken.output
    assert "broken: not certified" in broken.stdout
    assert broken.report["verdict"] == "not certified"


@pytest.mark.parametrize("provider", sorted(EXPECTED))
def test_each_broken_provider_fails_naming_what_and_where(broken, provider):
    op, case = EXPECTED[provider]
    test = f"test_ops::test_provider_matches_reference[{op}-{provider}-bfloat16]"
    results = {t["id"]: t for t in broken.report["tests"]}
    assert results[test]["state"] == "failed", results[test]
    message = results[test]["message"]
    for part in ("plugin 'broken'", f"provider {provider!r}", f"op {op!r}", "torch.bfloat16", f"case {case!r}"):
        assert part in message, f"{part} missing from: {message}"
    assert f"FAILED {test}" in broken.stdout
    cell = next(c for c in broken.report["coverage"] if (c["op"], c["provider"]) == (op, provider))
    assert cell["passed"] < cell["total"]


def test_the_failure_says_what_is_wrong(broken):
    results = {t["id"]: t["message"] for t in broken.report["tests"]}
    assert (
        "dtype torch.float32, expected torch.bfloat16"
        in results["test_ops::test_provider_matches_reference[silu_and_mul-fp32_silu_and_mul-bfloat16]"]
    )
    assert "got nan" in results["test_ops::test_provider_matches_reference[rms_norm-nan_rms_norm-bfloat16]"]
