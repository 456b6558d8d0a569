"""vLLM's own ``LLM`` with the bridge, against vLLM alone (runs where vLLM's venv is: ``dev/setup-vllm-peer``).

CI cannot install vLLM, so these skip unless ``$VLLM_PEER_VENV`` (default ``/work/vllm-peer``) holds
a vLLM. They never change that venv: a session fixture makes a venv over it and this checkout's
``.venv`` (``dev/vllm-bridge-venv``), and every vLLM process runs in there, on the check's tiny Llama
3.1 (``vllm_port_vllm.check.tiny_llama``: ``llama3`` rope scaling, GQA: 4 heads of 32 over 2 KV heads,
2 layers), in float32 so that the tolerances are those of float32 kernels. The CPU plugin is
certified there (``vllm-port certify cpu --vllm require``), which runs the comparison with vLLM alone
as the certification's last stage; that certificate is what the other tests hand the bridge.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PEER = Path(os.environ.get("VLLM_PEER_VENV", "/work/vllm-peer"))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("vllm-peer"),  # one worker: its session fixtures (the venv, the certificate) made once
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
def certified(bridge_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``vllm-port certify cpu --vllm require`` in vLLM's environment: the suite, then the stage inside vLLM
    (the tiny Llama in vLLM with the bridge against vLLM alone, eager and compiled); its report and folder."""
    out = tmp_path_factory.mktemp("cert")
    cmd = [str(bridge_python), "-m", "vllm_port.cli", "certify", "cpu", "--vllm", "require", "--report", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True, text=True, timeout=3600)
    assert (out / "report.json").is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    return {"report": json.loads((out / "report.json").read_text()), "path": out / "report.json", "done": done}


@pytest.fixture(scope="session")
def certificate(certified: dict) -> Path:
    """The CPU plugin's certificate, made here inside vLLM: what the bridge asks for."""
    assert certified["report"]["verdict"] == "certified", certified["report"]["reason"]
    return certified["path"]


def _build(bridge_python: Path, tmp_path_factory: pytest.TempPathFactory, builder: str) -> Path:
    """One of the check's tiny models (``vllm_port_vllm.check.<builder>``), built in vLLM's environment."""
    out = tmp_path_factory.mktemp(builder)
    code = f"import sys; from pathlib import Path; from vllm_port_vllm.check import {builder}; {builder}(Path(sys.argv[1]))"
    subprocess.run([str(bridge_python), "-c", code, str(out)], check=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def tiny_llama(bridge_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The check's own tiny Llama 3.1."""
    return _build(bridge_python, tmp_path_factory, "tiny_llama")


@pytest.fixture(scope="session")
def tiny_mixtral(bridge_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The check's tiny Mixtral."""
    return _build(bridge_python, tmp_path_factory, "tiny_mixtral")


def _check_report(bridge_python: Path, env: dict[str, str], *args: str) -> dict:
    """``python -m vllm_port_vllm.check ARGS --json`` in vLLM's environment: its report."""
    cmd = [str(bridge_python), "-m", "vllm_port_vllm.check", *args, "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3000)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-4000:]
    return json.loads(lines[-1])


def _env(certificate: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")}
    env.update({"VLLM_PORT_CERTIFICATE": str(certificate), "VLLM_PORT_PLUGINS": "cpu", "OMP_NUM_THREADS": "2"})
    return env


def test_certification_inside_vllm_matches_vllm_alone_and_calls_every_bridged_op_eager_and_compiled(
    certified: dict, bridge_python: Path
) -> None:
    """The stage inside vLLM, as ``vllm-port certify`` runs it: logprobs within the ops' tolerance of vLLM alone,
    a differing greedy id only at a proven near-tie, every bridged op a Llama runs called, in both modes; then the
    same for a tiny Mixtral, its experts on the plugin's fused_moe."""
    report = certified["report"]
    stage = report["vllm"]
    assert stage["ran"] and stage["ok"], stage
    assert stage["vllm_version"].startswith("0.32"), stage
    for mode in ("eager", "compiled"):
        m = stage["modes"][mode]
        assert m["worst_prefill"] <= 1 and m["worst_decode"] <= 1, (mode, m)
        assert all(d["tie"] for d in m["divergences"]), (mode, m["divergences"])  # a differing id is a proven near-tie
        assert not m["uncalled"], (mode, m["calls"])  # every bridged op a Llama runs was called in vLLM
        assert all(p.startswith("cpu/") for ps in m["providers"].values() for p in ps), (mode, m["providers"])
    moe = stage["moe"]  # then a mixture of experts, every expert layer on the plugin's fused_moe
    assert moe["ok"] and moe["model"] == "tiny-mixtral", moe
    for mode in ("eager", "compiled"):
        m = moe["modes"][mode]
        assert m["calls"]["fused_moe"] > 0 and not m["uncalled"], (mode, m["calls"])
        assert all(p.startswith("cpu/") for ps in m["providers"].values() for p in ps), (mode, m["providers"])
    assert report["verdict"] == "certified" and "vllm_port_vllm" in report["source"]["packages"]
    rendered = (certified["path"].parent / "report.md").read_text()
    assert "## Inside vLLM" in rendered and "a mixture of experts (tiny-mixtral)" in rendered
    verified = subprocess.run(
        [str(bridge_python), "-m", "vllm_port.cli", "certify", "--verify", str(certified["path"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert verified.returncode == 0 and "source: the same as" in verified.stdout, verified.stdout + verified.stderr


#: the bridged ops of attention: with ``VLLM_BRIDGE_KEEP=attention`` vLLM's own backend runs and none of them is called
_ATTENTION_OPS = {"reshape_and_cache", "prefill_attention", "paged_attention"}


def test_a_kept_part_runs_on_vllms_kernels_and_the_rest_still_on_the_plugins(
    bridge_python: Path, certificate: Path
) -> None:
    """``VLLM_BRIDGE_KEEP=attention``: the check finds exactly the attention ops uncalled, every other bridged op
    called, and the logits still within the tolerance of vLLM alone."""
    env = {**_env(certificate), "VLLM_BRIDGE_KEEP": "attention"}
    for mode, m in _check_report(bridge_python, env, "--tiny-llama")["modes"].items():
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


def test_a_plugin_fresh_from_new_plugin_certifies_inside_vllm(bridge_python: Path, tmp_path: Path) -> None:
    """What a vendor has on day one: ``vllm-port new-plugin`` (the reference ops and core's memory and comm, on the
    host CPU), installed beside vLLM, certifies through the suite and then inside vLLM on its own kernels."""
    from vllm_port.scaffold import new_plugin

    package = new_plugin("vllmchip", tmp_path / "vllm-port-vllmchip").root
    site = tmp_path / "site"
    pip = [str(REPO / ".venv" / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(package)], check=True, timeout=600, capture_output=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS",) and not k.startswith("VLLM_PORT_")}
    env.update(PYTHONPATH=str(site), OMP_NUM_THREADS="2")
    out = tmp_path / "cert"
    cmd = [str(bridge_python), "-m", "vllm_port.cli", "certify", "vllmchip", "--vllm", "require", "--report", str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "certified", (report["reason"], done.stdout[-3000:], done.stderr[-3000:])
    stage = report["vllm"]
    assert stage["ran"] and stage["ok"], stage
    for mode, m in stage["modes"].items():
        assert not m["uncalled"] and all(d["tie"] for d in m["divergences"]), (mode, m)
        ran = {provider for providers in m["providers"].values() for provider in providers}
        assert ran and all(provider.startswith("vllmchip/") for provider in ran), (mode, m["providers"])


def test_an_fp8_model_runs_its_linear_layers_on_the_plugins_fp8_linear_eager_and_compiled(
    bridge_python: Path, certificate: Path
) -> None:
    """The tiny Llama as compressed-tensors' FP8-dynamic checkpoint: vLLM builds its FP8 layers on the bridge's
    kernel, every projection calls the plugin's ``fp8_linear``, logits within the tolerance of vLLM alone."""
    for mode, m in _check_report(bridge_python, _env(certificate), "--tiny-llama-fp8")["modes"].items():
        assert m["ok"], (mode, m)
        assert m["calls"]["fp8_linear"] > 0 and m["providers"]["fp8_linear"] == ["cpu/cpu_fp8_linear"], (mode, m)


@pytest.mark.parametrize(("model", "modes"), [("mixtral", "eager,compiled"), ("qwen3-moe", "eager")])
def test_a_mixture_of_experts_runs_its_experts_on_the_plugins_fused_moe(
    bridge_python: Path, certificate: Path, model: str, modes: str
) -> None:
    """A tiny Mixtral (router outside the MoE layer) and a tiny Qwen3-MoE (vLLM's runner computes the router logits):
    vLLM hands the bridge's method the router logits, every MoE layer calls the plugin's ``fused_moe``, and the
    logits stay within the tolerance of vLLM alone (its own CPU MoE kernel), greedy ids equal."""
    report = _check_report(bridge_python, _env(certificate), f"--tiny-{model}", "--modes", modes)
    assert report["model"] == f"tiny-{model}" and list(report["modes"]) == modes.split(",")
    for mode, m in report["modes"].items():
        assert m["ok"] and m["equal_requests"] == m["requests"], (mode, m)
        assert m["calls"]["fused_moe"] > 0 and m["providers"]["fused_moe"] == ["cpu/cpu_fused_moe"], (mode, m)


def test_a_mixture_of_experts_routed_otherwise_than_fused_moe_stops_vllm_naming_the_setting(
    bridge_python: Path, certificate: Path, tiny_mixtral: Path
) -> None:
    """vLLM's router is not called on the bridge: a setting that routes otherwise (here vLLM's simulated router)
    stops vLLM when the layer is built, naming it, rather than run either kernel in silence."""
    env = {**_env(certificate), "VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"}
    code = f"from vllm import LLM; LLM(model={str(tiny_mixtral)!r}, skip_tokenizer_init=True, enforce_eager=True)"
    done = subprocess.run([str(bridge_python), "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    said = done.stdout + done.stderr  # vLLM's worker logs the refusal; its engine core then fails to start
    assert "BridgeError" in said and "a simulated router" in said and "VLLM_BRIDGE_KEEP=fused_moe" in said, said[-4000:]


_MOE_SETTINGS = """
import json, os, types
from vllm_port_vllm.errors import BridgeError
from vllm_port_vllm.moe import _refuse_config, _refuse_routing

NS = types.SimpleNamespace


class VllmPortMoEMethod:  # stands for the bridge's method, as the runner finds it on the experts
    pass


class Fp8MoEMethod:
    pass


class ZeroExpertRouter:
    pass


def config(**changed):
    parallel = {"use_ep": False, "dp_size": 1, "pcp_size": 1, "sp_size": 1, "enable_eplb": False}
    parallel.update({k[len("parallel_"):]: changed.pop(k) for k in list(changed) if k.startswith("parallel_")})
    fields = {"activation": "silu", "has_bias": False, "is_lora_enabled": False, "has_hash_routing": False,
              "swiglu_limit": None, "swiglu_alpha": None, "swiglu_beta": None, "activation_situ_beta": None,
              "activation_situ_linear_beta": None, "moe_backend": "auto", "moe_parallel_config": NS(**parallel)}
    return NS(**{**fields, **changed})


def runner(**changed):
    experts = {"quant_method": VllmPortMoEMethod(), "scoring_func": "softmax", "routed_scaling_factor": 1.0,
               "use_grouped_topk": False, "custom_routing_function": None, "e_score_correction_bias": None,
               "apply_router_weight_on_input": False, "expert_map_manager": NS(num_fused_shared_experts=0)}
    experts.update({k[len("experts_"):]: changed.pop(k) for k in list(changed) if k.startswith("experts_")})
    fields = {"routed_experts": NS(**experts), "router": NS(), "routed_input_transform": None,
              "routed_output_transform": None, "gate": None, "shared_expert_gate": None, "enable_dbo": False}
    return NS(**{**fields, **changed})


said = {}


def attempt(label, check, value, **env):
    os.environ.update(env)
    try:
        check(value)
        said[label] = "taken"
    except BridgeError as exc:
        said[label] = str(exc)
    for name in env:
        del os.environ[name]


attempt("plain config", _refuse_config, config())
attempt("gelu_tanh", _refuse_config, config(activation="gelu_tanh"))
attempt("plain routing", _refuse_routing, runner())
attempt("sigmoid", _refuse_routing, runner(experts_scoring_func="sigmoid"))
attempt("runner scales the output", _refuse_routing, runner(routed_scaling_factor=2.5))
for label, changed in {
    "the activation 'relu2'": {"activation": "relu2"},
    "biases on the experts' projections": {"has_bias": True},
    "LoRA adapters": {"is_lora_enabled": True},
    "hash routing": {"has_hash_routing": True},
    "swiglu_limit=7.0": {"swiglu_limit": 7.0},
    "moe_backend 'triton'": {"moe_backend": "triton"},
    "expert parallelism": {"parallel_use_ep": True},
    "data parallelism": {"parallel_dp_size": 2},
    "context parallelism": {"parallel_pcp_size": 2},
    "sequence parallelism": {"parallel_sp_size": 2},
    "expert load balancing": {"parallel_enable_eplb": True},
}.items():
    attempt(label, _refuse_config, config(**changed))
attempt("VLLM_BATCH_INVARIANT=1", _refuse_config, config(), VLLM_BATCH_INVARIANT="1")
attempt("a simulated router", _refuse_routing, runner(), VLLM_MOE_ROUTING_SIMULATION_STRATEGY="uniform_random")
for label, changed in {
    "quantised experts (Fp8MoEMethod)": {"experts_quant_method": Fp8MoEMethod()},
    "zero experts": {"router": ZeroExpertRouter()},
    "scoring_func 'sqrtsoftplus'": {"experts_scoring_func": "sqrtsoftplus"},
    "routed_scaling_factor=2.5": {"experts_routed_scaling_factor": 2.5},
    "grouped top-k routing": {"experts_use_grouped_topk": True},
    "a custom routing function": {"experts_custom_routing_function": print},
    "a score correction bias": {"experts_e_score_correction_bias": 0.0},
    "router weights applied to the input": {"experts_apply_router_weight_on_input": True},
    "shared experts fused into the routed ones": {"experts_expert_map_manager": NS(num_fused_shared_experts=1)},
    "a transform of the routed experts' input": {"routed_input_transform": print},
    "a transform of the routed experts' output": {"routed_output_transform": print},
    "a shared-expert gate fused into the router": {"gate": print, "shared_expert_gate": print},
    "dual-batch overlap": {"enable_dbo": True},
}.items():
    attempt(label, _refuse_routing, runner(**changed))
print(json.dumps(said))
"""


def test_each_moe_setting_fused_moe_does_not_compute_is_refused_by_name(bridge_python: Path) -> None:
    """The checks the bridge's MoE method and runner make when vLLM builds a layer, on stand-ins for vLLM's config,
    experts and runner: each setting that would route or combine otherwise than ``fused_moe`` is refused, naming
    it and ``VLLM_BRIDGE_KEEP=fused_moe``; plain softmax or sigmoid top-k with SiLU or GELU is taken (and a runner
    that scales the block's output itself, as vLLM's does after the method)."""
    done = subprocess.run([str(bridge_python), "-c", _MOE_SETTINGS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    for label in ("plain config", "gelu_tanh", "plain routing", "sigmoid", "runner scales the output"):
        assert said.pop(label) == "taken", label
    for label, message in said.items():
        assert message.startswith("vllm-port bridge:") and label in message, (label, message)
        assert "VLLM_BRIDGE_KEEP=fused_moe" in message, message


_FP8_CONFIGS = """
import json, torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
from vllm.model_executor.layers.quantization.utils import quant_utils as q
from vllm_port_vllm.errors import BridgeError
from vllm_port_vllm.fp8 import _kernel_class

kernel = _kernel_class()
said = {}
for label, weights, activations in [
    ("channel weights, dynamic token activations", q.kFp8StaticChannelSym, q.kFp8DynamicTokenSym),
    ("tensor weights, dynamic token activations", q.kFp8StaticTensorSym, q.kFp8DynamicTokenSym),
    ("tensor weights, static tensor activations", q.kFp8StaticTensorSym, q.kFp8StaticTensorSym),
    ("channel weights, dynamic tensor activations", q.kFp8StaticChannelSym, q.kFp8DynamicTensorSym),
    ("per-row weights, dynamic token activations", q.kFp8StaticTokenSym, q.kFp8DynamicTokenSym),
    ("channel weights, static token activations", q.kFp8StaticChannelSym, q.kFp8StaticTokenSym),
]:
    config = FP8ScaledMMLinearLayerConfig(weight_quant_key=weights, activation_quant_key=activations,
                                          weight_shape=(64, 32), input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    try:
        said[label] = str(kernel.can_implement(config))
    except BridgeError as exc:
        said[label] = str(exc)
print(json.dumps(said))
"""


def test_fp8_layers_the_op_does_not_compute_are_refused_naming_what_they_ask(bridge_python: Path) -> None:
    """Static activation scales from the checkpoint are another computation than ``fp8_linear``'s on-the-fly one:
    the bridge's kernel refuses them by name (never leaving them to vLLM's kernel in silence). Dynamic scales of
    any granularity (vLLM's CPU build runs vLLM's own ``fp8`` format per tensor) and weights with one scale per
    tensor or per output row (vLLM calls that "per channel" or "per token") are taken."""
    done = subprocess.run([str(bridge_python), "-c", _FP8_CONFIGS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    for label in ("channel weights, dynamic token activations", "tensor weights, dynamic token activations",
                  "channel weights, dynamic tensor activations", "per-row weights, dynamic token activations"):  # fmt: skip
        assert said[label] == "(True, None)", (label, said[label])
    for label in ("tensor weights, static tensor activations", "channel weights, static token activations"):
        assert "vllm-port bridge" in said[label] and "VLLM_BRIDGE_KEEP=fp8_linear" in said[label], said[label]
        assert "static activation scales" in said[label], said[label]


_FP8_SETTINGS = """
import json, os, torch
from vllm.config import KernelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.kernels import linear
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearLayerConfig
from vllm.model_executor.layers.quantization.utils import quant_utils as q
from vllm.platforms import current_platform
from vllm_port_vllm.errors import BridgeError
from vllm_port_vllm.fp8 import _kernel_class, register_fp8

register_fp8()
config = FP8ScaledMMLinearLayerConfig(weight_quant_key=q.kFp8StaticChannelSym, activation_quant_key=q.kFp8DynamicTokenSym,
                                      weight_shape=(64, 32), input_dtype=torch.bfloat16, out_dtype=torch.bfloat16)


class TakesAnything:  # stands for a kernel vLLM has for a list the bridge is not in (none on this CPU)
    is_supported = classmethod(lambda cls, compute_capability=None: (True, None))
    can_implement = classmethod(lambda cls, c: (True, None))


for kernels in (linear._POSSIBLE_FP8_BLOCK_KERNELS, linear._POSSIBLE_WFP8A16_KERNELS):
    kernels.setdefault(current_platform._enum, []).append(TakesAnything)
said = {}


def attempt(label, scheme="fp8_w8a8", kernels=linear._POSSIBLE_FP8_KERNELS, **env):
    os.environ.update(env)
    try:
        if env.get("VLLM_BATCH_INVARIANT"):
            said[label] = str(_kernel_class()(config, ["weight", "weight_scale", "input_scale", "input_scale_ub"]))
        else:
            said[label] = linear.choose_scaled_mm_linear_kernel(config, kernels, quantization=scheme).__name__
    except BridgeError as exc:
        said[label] = str(exc)
    for name in env:
        del os.environ[name]


attempt("default")
attempt("disabled", VLLM_DISABLED_KERNELS="VllmPortFp8Kernel")
attempt("batch invariant", VLLM_BATCH_INVARIANT="1")
attempt("blocks", "fp8_block_w8a8", linear._POSSIBLE_FP8_BLOCK_KERNELS)
attempt("weight-only", "w8a16_fp8", linear._POSSIBLE_WFP8A16_KERNELS)
with set_current_vllm_config(VllmConfig(kernel_config=KernelConfig(linear_backend="torch"))):
    attempt("linear backend")
print(json.dumps(said))
"""


def test_fp8_layers_vllm_would_give_its_own_kernel_are_refused_naming_the_cause(bridge_python: Path) -> None:
    """Every FP8 linear layer chooses its kernel through vLLM's ``choose_scaled_mm_linear_kernel``: where a setting
    (``VLLM_DISABLED_KERNELS``, a linear backend, batch invariance) or the layer's scheme (weights in blocks, FP8
    weights only) would give it one of vLLM's kernels, the bridge refuses when the layer is built, naming the
    cause; with none of them the bridge's kernel is chosen."""
    done = subprocess.run([str(bridge_python), "-c", _FP8_SETTINGS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    assert said.pop("default") == "VllmPortFp8Kernel"
    causes = {
        "disabled": "VLLM_DISABLED_KERNELS naming VllmPortFp8Kernel",
        "batch invariant": "VLLM_BATCH_INVARIANT=1",
        "blocks": "weights in blocks",
        "weight-only": "FP8 weights only",
        "linear backend": "the linear backend 'torch'",
    }
    for label, cause in causes.items():
        assert said[label].startswith("vllm-port bridge:") and cause in said[label], (label, said[label])
        assert "VLLM_BRIDGE_KEEP=fp8_linear" in said[label], said[label]
