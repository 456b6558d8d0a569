"""vLLM's own ``LLM`` with the bridge, against vLLM alone (runs where vLLM's venv is: ``dev/setup-vllm-peer``).

CI cannot install vLLM, so these skip unless ``$VLLM_PEER_VENV`` (default ``/work/vllm-peer``) holds
a vLLM. They never change that venv: a session fixture makes a venv over it and this checkout's
``.venv`` (``dev/vllm-bridge-venv``), and every vLLM process runs in there, on a tiny Llama 3.1 built with ``transformers`` (``llama3``
rope scaling, GQA: 4 heads of 32 over 2 KV heads, 2 layers), in float32 so that the tolerances
are those of float32 kernels.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PEER = Path(os.environ.get("VLLM_PEER_VENV", "/work/vllm-peer"))
REPORT = REPO / "docs" / "certification" / "cpu" / "report.json"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (PEER / "bin" / "python").exists()
        or not list((PEER / "lib").glob("python3*/site-packages/vllm/__init__.py")),
        reason=f"no vLLM venv at {PEER} (dev/setup-vllm-peer makes one; CI has none)",
    ),
]


@pytest.fixture(scope="session")
def bridge_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``dev/vllm-bridge-venv``: a venv over vLLM's that sees this checkout's packages (vLLM's venv left as it is)."""
    venv = tmp_path_factory.mktemp("bridge-venv") / "venv"
    subprocess.run([str(REPO / "dev" / "vllm-bridge-venv"), str(venv)], check=True, timeout=600, cwd=REPO)
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def certificate(bridge_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The committed CPU report when it certifies this checkout's sources; otherwise that report made to
    certify them (its sha256 recomputed and re-digested: the bridge's routing is under test here, the
    certificate's checks in test_certificate.py)."""
    out = tmp_path_factory.mktemp("cert") / "report.json"
    code = (
        "import json, sys; from vllm_port_conformance.certify import digest, source_digest, verify; "
        "r = json.load(open(sys.argv[1])); s = source_digest(r['source']['packages']); "
        "r['source'] = {**r['source'], **s} if s['sha256'] != r['source']['sha256'] else r['source']; "
        "r['digest'] = digest(r); json.dump(r, open(sys.argv[2], 'w'))"
    )
    subprocess.run([str(bridge_python), "-c", code, str(REPORT), str(out)], check=True, timeout=120)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # unit-scale weights: transformers' tiny init makes every layer nearly the identity
        for name, p in model.named_parameters():
            p.copy_(
                torch.randn_like(p) * (0.3 if "norm" in name else p.shape[-1] ** -0.5) + (1 if "norm" in name else 0)
            )
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out, safe_serialization=True)
    return out


def _env(certificate: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env.update({"VLLM_PORT_CERTIFICATE": str(certificate), "VLLM_PORT_PLUGINS": "cpu", "OMP_NUM_THREADS": "2"})
    return env


def test_logits_match_vllm_alone_and_every_bridged_op_runs_eager_and_compiled(
    bridge_python: Path, certificate: Path, tiny_llama: Path
) -> None:
    cmd = [str(bridge_python), "-m", "vllm_port_vllm.check", "--model", str(tiny_llama), "--json"]
    done = subprocess.run(cmd, env=_env(certificate), capture_output=True, text=True, timeout=3000)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-4000:]
    report = json.loads(lines[-1])
    for mode in ("eager", "compiled"):
        m = report["modes"][mode]
        assert m["worst_prefill"] <= 1 and m["worst_decode"] <= 1, (mode, m)
        assert all(d["tie"] for d in m["divergences"]), (mode, m["divergences"])  # a differing id is a proven near-tie
        assert not m["uncalled"], (mode, m["calls"])  # every bridged op a Llama runs was called in vLLM
    assert report["ok"], report


#: the bridged ops of attention: with ``VLLM_BRIDGE_KEEP=attention`` vLLM's own backend runs and none of them is called
_ATTENTION_OPS = {"reshape_and_cache", "prefill_attention", "paged_attention"}


def test_a_kept_part_runs_on_vllms_kernels_and_the_rest_still_on_the_plugins(
    bridge_python: Path, certificate: Path, tiny_llama: Path
) -> None:
    """``VLLM_BRIDGE_KEEP=attention``: the check finds exactly the attention ops uncalled, every other bridged op
    called, and the logits still within the tolerance of vLLM alone."""
    env = {**_env(certificate), "VLLM_BRIDGE_KEEP": "attention"}
    cmd = [str(bridge_python), "-m", "vllm_port_vllm.check", "--model", str(tiny_llama), "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-4000:]
    for mode, m in json.loads(lines[-1])["modes"].items():
        assert set(m["uncalled"]) == _ATTENTION_OPS & set(m["calls"]), (mode, m["calls"])
        assert all(n > 0 for op, n in m["calls"].items() if op not in _ATTENTION_OPS | {"gelu_and_mul"}), (mode, m)
        assert m["worst_prefill"] <= 1 and m["worst_decode"] <= 1, (mode, m)


def test_without_a_certificate_vllm_refuses_to_start_naming_the_plugin(
    bridge_python: Path, certificate: Path, tiny_llama: Path
) -> None:
    env = _env(certificate)
    env.pop("VLLM_PORT_CERTIFICATE")
    code = f"from vllm import LLM; LLM(model={str(tiny_llama)!r}, skip_tokenizer_init=True, enforce_eager=True)"
    done = subprocess.run([str(bridge_python), "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert "BridgeError" in done.stderr and "plugin 'cpu'" in done.stderr and "has no certificate" in done.stderr
