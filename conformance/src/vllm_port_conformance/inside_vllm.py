"""The certification's last stage: the plugin's kernels inside vLLM, through the vLLM bridge.

Where vLLM and the bridge (``vllm-port-vllm``) are installed beside the plugin, ``vllm-port certify``
runs, once the whole suite has passed, ``python -m vllm_port_vllm.check --tiny-llama``: a tiny
Llama 3.1 in vLLM alone and in vLLM with the bridge on the plugin's kernels, eager and compiled; the
whole vocabulary's logprobs compared element by element within the bridged ops' tolerances, a
differing greedy id allowed only at a proven near-tie, and every bridged op called. Then the same
with ``--tiny-mixtral``, a mixture of experts whose layers vLLM hands to the plugin's ``fused_moe``
(the report's ``vllm.moe``). The bridge runs
only certified kernels, so it is handed the report the suite has just made (a certificate of these
very sources, whose ``vllm`` field says the stage is under way); the stage's result becomes the final
report's ``vllm`` field, and a failure there refuses the plugin.

Without vLLM or the bridge the stage does not run and the report says why (``--vllm require`` makes
that an error instead; ``--vllm skip`` leaves the stage out on purpose).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["BRIDGE_PACKAGE", "MODES", "UNDER_WAY", "failure", "missing", "not_run", "run"]

#: ``--vllm``: run the stage where vLLM and the bridge are installed, never, or insist on it
MODES = ("auto", "skip", "require")
#: the bridge's import package: its sources run in the stage, so they join the report's source digest
BRIDGE_PACKAGE = "vllm_port_vllm"
#: the ``vllm`` field of the certificate handed to the bridge while the stage runs
UNDER_WAY = "the stage inside vLLM is under way with this report as its certificate; the final report holds its result"
#: seconds each model's check may take: four vLLM processes (two compile) on a tiny model
TIMEOUT_S = 3000
#: the check's tiny models: the dense one whose result is the ``vllm`` field, and the mixture of experts
#: whose result is its ``moe`` (``vllm_port_vllm.check``'s flags)
DENSE, MOE = "--tiny-llama", "--tiny-mixtral"


def missing() -> str | None:
    """Why the stage cannot run in this interpreter (vLLM or the bridge is not importable), or ``None``."""
    for module, what in (("vllm", "vLLM"), (BRIDGE_PACKAGE, "the vLLM bridge (vllm-port-vllm)")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed beside the plugin"
    return None


def not_run(why: str) -> dict[str, Any]:
    """The ``vllm`` field of a report whose stage did not run, and why."""
    return {"ran": False, "why": why}


def run(plugin: str, certificate: Path, timeout_s: int = TIMEOUT_S) -> dict[str, Any]:
    """Run the bridge's check on ``plugin`` with ``certificate``: the ``vllm`` field of the final report.

    The dense model's result, with the mixture of experts' as its ``moe``. ``ok`` is both checks'
    verdict; a check that could not finish is ``ok: False`` with its ``error``.
    """
    dense = _check(plugin, certificate, DENSE, timeout_s)
    moe = _check(plugin, certificate, MOE, timeout_s)
    return {**dense, "ok": bool(dense.get("ok") and moe.get("ok")), "moe": moe}


def _check(plugin: str, certificate: Path, model: str, timeout_s: int) -> dict[str, Any]:
    """One model's check inside vLLM (``model``: the check's flag); its JSON report, or ``ok: False`` and why."""
    cmd = [sys.executable, "-m", f"{BRIDGE_PACKAGE}.check", model, "--json"]
    env = {**os.environ, "VLLM_PORT_CERTIFICATE": str(certificate), "VLLM_PORT_PLUGINS": plugin}
    try:
        # S603: this interpreter running the bridge's installed check module, no shell
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)  # noqa: S603
    except subprocess.TimeoutExpired:
        return {"ran": True, "ok": False, "error": f"the check {model} inside vLLM took longer than {timeout_s} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        said = (done.stderr or done.stdout).strip()[-3000:]
        return {"ran": True, "ok": False, "error": f"the check {model} inside vLLM exited {done.returncode}: {said}"}
    return {"ran": True, **json.loads(lines[-1])}


def failure(result: dict[str, Any]) -> str | None:
    """What failed inside vLLM, in one sentence, or ``None`` when the stage passed or did not run."""
    if not result.get("ran") or result.get("ok"):
        return None
    said = [_model_failure(result)]
    if result.get("moe"):  # reports before the mixture of experts joined the stage have none
        said.append(_model_failure(result["moe"]))
    return "; ".join(what for what in said if what) or "failed"


def _model_failure(result: dict[str, Any]) -> str | None:
    """What failed in one model's check (its error, or each failed mode), naming the model; ``None`` when nothing
    did. Read from the modes, not ``ok``: the dense model's result carries the whole stage's ``ok``."""
    if result.get("error"):
        return str(result["error"])
    said = []
    for mode, m in sorted((result.get("modes") or {}).items()):
        if m.get("ok"):
            continue
        parts = []
        if m.get("worst_prefill", 0) > 1 or m.get("worst_decode", 0) > 1:
            parts.append(
                f"logprobs {m.get('worst_prefill', 0):.3g}x (prompts) and {m.get('worst_decode', 0):.3g}x (steps) "
                "of the tolerance away from vLLM alone's"
            )
        parts += [
            f"request {d['request']} first differs at step {d['step']}, where vLLM alone's top two are "
            f"{d['gap']:.3g} apart (a near-tie is within {d['tie_bound']:.3g})"
            for d in m.get("divergences", ())
            if not d.get("tie")
        ]
        if m.get("uncalled"):
            parts.append(f"bridged ops never called: {', '.join(m['uncalled'])}")
        said.append(f"{result.get('model', 'the model')} {mode}: " + "; ".join(parts or ["failed"]))
    return "; ".join(said) or None
