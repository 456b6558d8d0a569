"""Certification against vLLM: one model in vLLM with and without the bridge, logits compared within the ops' tolerances.

Run in vLLM's environment, with the bridge and a certified plugin installed::

    VLLM_PORT_CERTIFICATE=cert/report.json python -m vllm_port_vllm.check --model DIR [--dtype float32] [--json]
    VLLM_PORT_CERTIFICATE=cert/report.json python -m vllm_port_vllm.check --tiny-llama [--json]

``--tiny-llama`` builds the model itself with ``transformers`` (a dependency of vLLM's): the Llama 3.1
of :func:`tiny_llama`, random unit-scale weights. ``vllm-port certify`` runs it so as its last stage
where vLLM and the bridge are installed (``vllm_port_conformance.inside_vllm``).

For each mode (``eager``: ``enforce_eager``; ``compiled``: vLLM's torch.compile) two fresh vLLM
processes run the same greedy requests, one with the bridge (``VLLM_PLUGINS`` unset) and one
without (``VLLM_PLUGINS=""``: vLLM alone). Each returns its greedy ids with the whole vocabulary's
logprobs at every step (decode attention), and the logprobs of every position of vLLM-alone's
sequences scored as prompts (prefill attention, the same inputs on both sides). The check passes
when:

- every logprob of the bridged run is within the tolerance of vLLM-alone's, element by element:
  ``atol + rtol * |x|`` of the least strict bridged op for the dtype (the attention ops'), over the
  scored prompts and over each request's steps up to its first differing id (past it the inputs differ);
- each request's greedy ids equal vLLM-alone's, or first differ where vLLM-alone's top two logprobs
  are a near-tie (within twice that tolerance), which the report shows for each such request;
- the bridged process counted more than zero calls of every bridged op (``VLLM_PORT_STATS``).

A mixture-of-experts model (``--tiny-mixtral``, ``--tiny-qwen3-moe``, or a checkpoint whose config has
experts) must call ``fused_moe`` too; its tolerance joins the others'.

An FP8 model (``--tiny-llama-fp8``, or a checkpoint with a ``quantization_config``) is judged against vLLM alone
on its dequantised checkpoint, ``fp8_linear``'s reference, with vLLM's own FP8 kernels as the yardstick of
how far a quantised run may land from it (:func:`_check_fp8`); ``fp8_linear`` must be called too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "FP8_DYNAMIC",
    "compare",
    "main",
    "tiny_llama",
    "tiny_llama_fp8",
    "tiny_mixtral",
    "tiny_qwen3_moe",
    "tolerance",
]

#: vLLM's settings for a small run on a shared CPU (the KV cache in GiB, no reserved core)
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu"}


def tolerance(dtype: str, ops: tuple[str, ...] | None = None) -> tuple[float, float]:
    """``(atol, rtol)``: the least strict tolerance of ``ops`` (default: the bridged layers' and attention's) for ``dtype``."""
    import torch

    from vllm_port.ops import ALL_OPS

    from .runtime import BRIDGED_OPS

    want = getattr(torch, dtype)
    ops = BRIDGED_OPS if ops is None else ops
    tols = [op.tolerances[want] for op in ALL_OPS if op.name in ops and want in op.tolerances]
    return max(t.atol for t in tols), max(t.rtol for t in tols)


def tiny_llama(folder: Path) -> Path:
    """A tiny random Llama 3.1 saved in ``folder`` (config.json + safetensors): ``llama3`` rope scaling,
    grouped-query attention (4 heads of 32 over 2 KV heads), 2 layers, float32.

    The weights are unit-scale (transformers' own initialisation makes every layer nearly the identity,
    which would compare nothing): the norms near 1, every matrix scaled by its fan-in.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    )  # fmt: skip
    return _save_unit_scale(LlamaForCausalLM(config), folder)


def _save_unit_scale(model: Any, folder: Path) -> Path:
    """Give ``model`` unit-scale random weights (seed 0: norms near 1, every matrix scaled by its fan-in) and save it."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.copy_(noise * 0.3 + 1 if "norm" in name else noise * p.shape[-1] ** -0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_mixtral(folder: Path) -> Path:
    """A tiny random Mixtral saved in ``folder``: :func:`tiny_llama`'s attention and sizes, and in each of its 2
    layers a mixture of 4 experts (intermediate 256), each token routed to 2 of them (softmax, renormalised).

    Unit-scale weights as in :func:`tiny_llama`; the router's too, so tokens spread over the experts.
    """
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32", num_local_experts=4,
        num_experts_per_tok=2, sliding_window=None,
    )  # fmt: skip
    return _save_unit_scale(MixtralForCausalLM(config), folder)


def tiny_qwen3_moe(folder: Path) -> Path:
    """A tiny random Qwen3-MoE saved in ``folder``: per-head q/k norms, 8 experts of intermediate 64 in each of 2
    layers, 2 per token, renormalised (``norm_topk_prob``); vLLM's runner computes its router logits itself."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, torch_dtype="float32",
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return _save_unit_scale(Qwen3MoeForCausalLM(config), folder)


#: compressed-tensors' FP8-dynamic scheme: e4m3 weights with a scale per output channel, activations quantised per
#: token on the fly (what ``fp8_linear`` computes); the LM head stays float
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True},
    }},
}  # fmt: skip


def tiny_llama_fp8(folder: Path) -> Path:
    """:func:`tiny_llama` with its projections (q, k, v, o, gate, up, down) in e4m3, one scale per output channel,
    saved as compressed-tensors' FP8-dynamic checkpoint (:data:`FP8_DYNAMIC`): vLLM runs its FP8 linear layers."""
    import re

    from safetensors.torch import load_file, save_file

    from vllm_port.ops.fp8 import quantize_fp8_weight

    tiny_llama(folder)
    projection = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
    tensors = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if projection.fullmatch(name):
            tensors[name], scale = quantize_fp8_weight(tensor, "channel")
            tensors[name.removesuffix("weight") + "weight_scale"] = scale.reshape(-1, 1).contiguous()
        else:
            tensors[name] = tensor
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = FP8_DYNAMIC
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


#: ``--NAME``: the check's own tiny models, each built in a folder by its function, and what it is
_TINY_MODELS = {
    "tiny-llama": (tiny_llama, "a tiny random Llama 3.1 (tiny_llama)"),
    "tiny-llama-fp8": (tiny_llama_fp8, "the tiny Llama as an FP8-dynamic checkpoint (tiny_llama_fp8)"),
    "tiny-mixtral": (tiny_mixtral, "a tiny random Mixtral, 4 experts, top 2 (tiny_mixtral)"),
    "tiny-qwen3-moe": (tiny_qwen3_moe, "a tiny random Qwen3-MoE, 8 experts, top 2 (tiny_qwen3_moe)"),
}


#: tensors of an FP8 checkpoint that only a quantised run reads: the weights' scales (folded into the float weights)
#: and static activation or KV-cache scales (the bridge refuses static activation scales; the float run has none)
_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "input_scale", "input_scale_ub", "k_scale", "v_scale")


def dequantised(model: str, folder: Path) -> Path:
    """``model``'s FP8 checkpoint as the float checkpoint it means (each e4m3 weight times its per-tensor or
    per-channel scale, float32), saved in ``folder``: ``fp8_linear``'s reference, run by vLLM's float layers.

    :raises ValueError: for a weight without a scale, or with block scales (which the bridge does not route).
    """
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_port.ops.fp8 import dequantize_fp8_weight, scale_granularity

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        tensors.update(load_file(path))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(_SCALE_SUFFIXES):
            continue
        if tensor.dtype != torch.float8_e4m3fn:
            out[name] = tensor
            continue
        scale = tensors.get(name + "_scale", tensors.get(name + "_scale_inv"))
        if scale is None:
            raise ValueError(f"{model}: {name} is float8_e4m3fn but has no {name}_scale; cannot dequantise it")
        scale = scale.float().reshape(()) if scale.numel() == 1 else scale.float().reshape(-1)
        if scale_granularity(tensor, scale) not in ("tensor", "channel"):
            raise ValueError(
                f"{model}: {name} has scales of shape {tuple(scale.shape)} for a {tuple(tensor.shape)} weight; the check "
                "runs per-tensor and per-channel FP8 checkpoints (block scales are not routed by the bridge)"
            )
        out[name] = dequantize_fp8_weight(tensor, scale, torch.float32)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(model) / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _check_fp8(args: argparse.Namespace, mode: str, work: Path, ops: tuple[str, ...]) -> dict[str, Any]:
    """An FP8 model in ``mode``: vLLM alone on its dequantised checkpoint (the reference), vLLM alone on the FP8
    checkpoint (vLLM's FP8 kernels), and the bridge on it, each scoring the reference's sequences.

    ``fp8_linear`` may compute the exact product or quantise each token's activations (the contract allows
    both), so the bridged logits are judged against the reference by how far vLLM's own FP8 kernels land from
    it: the bridged run's worst difference must be at most twice theirs (or within the float tolerance).
    """
    atol, rtol = tolerance(args.dtype, ops)
    reference_model = str(work / "dequantised")
    if not (work / "dequantised" / "config.json").exists():  # once for every mode
        dequantised(args.model, work / "dequantised")
    reference = _run(args, mode, False, work, None, model=reference_model)
    (work / "score.json").write_text(json.dumps(reference["scored"]))
    own = _run(args, mode, False, work, work / "score.json")
    bridged = _run(args, mode, True, work, work / "score.json")
    vllm_fp8 = compare(reference, own, atol, rtol, ())
    result = compare(reference, bridged, atol, rtol, ops)
    bound = max(1.0, 2 * max(vllm_fp8["worst_prefill"], vllm_fp8["worst_decode"]))
    finite = math.isfinite(bound)  # vLLM's own FP8 run gave a non-finite logprob: no yardstick, no pass
    within = result["worst_prefill"] <= bound and result["worst_decode"] <= bound
    result["ok"] = finite and within and not result["uncalled"]
    result["against"] = "vLLM alone on the dequantised checkpoint"
    result["vllm_fp8"] = {k: vllm_fp8[k] for k in ("worst_prefill", "worst_decode", "equal_requests", "divergences")}
    result["bound"] = bound
    result["exits"] = {"reference": reference["exit"], "alone": own["exit"], "bridged": bridged["exit"]}
    result["vllm_version"] = reference["vllm_version"]
    return result


def _checked_ops(model: str) -> tuple[str, ...]:
    """The bridged ops a run of ``model`` must call: the layers' and attention's, ``fp8_linear`` for an FP8 model and
    ``fused_moe`` for a mixture of experts (``num_local_experts`` or ``num_experts`` in its config).

    :raises ValueError: for a checkpoint quantised otherwise (AWQ, GPTQ, int8...): the bridge routes none of those.
    """
    from .runtime import BRIDGED_OPS

    config = json.loads((Path(model) / "config.json").read_text())
    moe = ("fused_moe",) if (config.get("num_local_experts") or config.get("num_experts") or 0) > 0 else ()
    # a MoE model whose every MLP is its experts' (Mixtral; Qwen3-MoE by default) has no dense SiLU MLP to call
    dense = not moe or bool(
        config.get("mlp_only_layers")
        or config.get("decoder_sparse_step", 1) != 1
        or config.get("shared_expert_intermediate_size", 0)
    )
    quantization = config.get("quantization_config")
    if quantization is None:
        return tuple(op for op in BRIDGED_OPS if dense or op != "silu_and_mul") + moe
    method = quantization.get("quant_method")
    groups = quantization.get("config_groups", {}).values() if method == "compressed-tensors" else []
    fp8 = method == "fp8" or any(
        (g.get("weights") or {}).get("type") == "float" and (g.get("weights") or {}).get("num_bits") == 8
        for g in groups
    )
    if not fp8:
        raise ValueError(
            f"{model}: quantization_config.quant_method is {method!r}; the check runs float and FP8 checkpoints "
            "(quant_method 'fp8', or compressed-tensors with 8-bit float weights), the ones the bridge routes"
        )
    if moe:
        raise ValueError(
            f"{model}: a mixture of experts with a quantization_config; the bridge routes unquantised MoE layers "
            "(fused_moe) and FP8 linear layers, not FP8 experts"
        )
    return (*BRIDGED_OPS, "fp8_linear")


def _worker(args: argparse.Namespace) -> None:
    """One vLLM process: greedy ids and logprobs, and the scored sequences; one JSON line."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    longest = max(len(p) for p in prompts) + args.max_tokens + 1
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype=args.dtype,
        enforce_eager=args.mode == "eager",
        max_model_len=longest,
        max_num_seqs=len(prompts),
        max_logprobs=vocab,
        enable_prefix_caching=False,
        seed=0,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=vocab, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)

    def row(step: dict[int, Any]) -> list[float]:
        return [step[t].logprob for t in range(vocab)]

    import vllm

    result = {
        "vllm_version": vllm.__version__,
        "ids": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[row(s) for s in o.outputs[0].logprobs] for o in outs],
    }
    score = (
        json.loads(Path(args.score).read_text())
        if args.score
        else [p + ids for p, ids in zip(prompts, result["ids"], strict=True)]
    )
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab, detokenize=False)
    scored = llm.generate([{"prompt_token_ids": s} for s in score], scoring, use_tqdm=False)
    result["scored"] = score
    result["prompt_logprobs"] = [[row(s) for s in o.prompt_logprobs[1:]] for o in scored]
    print("RESULT " + json.dumps(result), flush=True)


def _run(
    args: argparse.Namespace, mode: str, bridged: bool, work: Path, score: Path | None, model: str | None = None
) -> dict[str, Any]:
    env = {**os.environ, **{k: v for k, v in CPU_ENV.items() if k not in os.environ}}
    stats = work / f"stats-{mode}.json"
    if bridged:
        env.pop("VLLM_PLUGINS", None)
        env["VLLM_PORT_STATS"] = str(stats)
    else:
        env["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin: vLLM alone
        env.pop("VLLM_PORT_STATS", None)
    cmd = [sys.executable, "-m", "vllm_port_vllm.check", "--worker", "--model", model or args.model]
    cmd += ["--dtype", args.dtype]
    cmd += ["--mode", mode, "--prompts", str(work / "prompts.json"), "--max-tokens", str(args.max_tokens)]
    cmd += ["--score", str(score)] if score else []
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)  # noqa: S603
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(
            f"vLLM ({mode}, {'with' if bridged else 'without'} the bridge) exited {done.returncode}: "
            f"{_root_cause(done.stderr or done.stdout)}"
        )
    # vLLM's CPU build now and then aborts while its threads shut down ("terminate called without an active
    # exception"), after the worker printed its whole result: the result stands, and the report shows the exit
    result = {**json.loads(lines[-1][len("RESULT ") :]), "exit": done.returncode}
    if bridged:
        result["stats"] = json.loads(stats.read_text())["calls"] if stats.exists() else {}
    return result


def _root_cause(said: str) -> str:
    """What a failed vLLM process said that matters: the bridge's refusal where there is one (vLLM's engine core
    reports it first, then its own "initialization failed" after it), else the end of its output."""
    refusals = [line.strip() for line in said.splitlines() if "BridgeError: " in line]
    return refusals[0] if refusals else said[-3000:]


def _worst(a: list[float], b: list[float], atol: float, rtol: float) -> float:
    """The largest ``|a - b| / (atol + rtol * |a|)`` over finite pairs: above 1 is out of tolerance."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if not (abs(x) < float("inf") and abs(y) < float("inf")):
            return float("inf")
        worst = max(worst, abs(x - y) / (atol + rtol * abs(x)))
    return worst


def compare(
    alone: dict[str, Any], bridged: dict[str, Any], atol: float, rtol: float, ops: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """What differs between vLLM alone and vLLM with the bridge, and whether it is within tolerance; ``ops``: the
    bridged ops that must have been called (default: the layers' and attention's)."""
    from .runtime import BRIDGED_OPS

    ops = BRIDGED_OPS if ops is None else ops

    worst_prefill = max(
        (
            _worst(a, b, atol, rtol)
            for ra, rb in zip(alone["prompt_logprobs"], bridged["prompt_logprobs"], strict=True)
            for a, b in zip(ra, rb, strict=True)
        ),
        default=0.0,
    )
    worst_decode, divergences = 0.0, []
    for i, (ids_a, ids_b) in enumerate(zip(alone["ids"], bridged["ids"], strict=True)):
        same = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)) if x != y), len(ids_a))
        for j in range(min(same + 1, len(ids_a))):  # the step that differs still had the same inputs
            worst_decode = max(worst_decode, _worst(alone["logprobs"][i][j], bridged["logprobs"][i][j], atol, rtol))
        if same < len(ids_a):
            lp = alone["logprobs"][i][same]
            a, b = lp[ids_a[same]], lp[ids_b[same]]
            bound = 2 * (atol + rtol * max(abs(a), abs(b)))
            divergences.append(
                {
                    "request": i,
                    "step": same,
                    "alone": ids_a[same],
                    "bridged": ids_b[same],
                    "gap": a - b,
                    "tie_bound": bound,
                    "tie": a - b <= bound,
                }
            )
    stats = bridged.get("stats", {})
    calls = {op: sum(stats.get(op, {}).values()) for op in ops}
    uncalled = sorted(op for op, n in calls.items() if op != "gelu_and_mul" and n <= 0)  # Llama has no GELU
    ok = worst_prefill <= 1 and worst_decode <= 1 and all(d["tie"] for d in divergences) and not uncalled
    return {
        "ok": ok,
        "worst_prefill": worst_prefill,
        "worst_decode": worst_decode,
        "requests": len(alone["ids"]),
        "equal_requests": len(alone["ids"]) - len(divergences),
        "divergences": divergences,
        "calls": calls,
        "providers": {op: sorted(stats.get(op, {})) for op in ops},  # "plugin/provider" that served it
        "uncalled": uncalled,
    }


def _prompts(model: str, count: int, length: int) -> list[list[int]]:
    import random

    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)  # noqa: S311 - prompts, not secrets
    return [[rng.randrange(1, vocab) for _ in range(length + 3 * i)] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_port_vllm.check", description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a Hugging Face model directory (config.json + safetensors)")
    for name, (_, what) in _TINY_MODELS.items():
        model.add_argument(f"--{name}", action="store_true", help=f"build {what} and run it")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=9)
    parser.add_argument("--timeout", type=int, default=900, help="seconds each vLLM process may take")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--score", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = next((name for name in _TINY_MODELS if getattr(args, name.replace("-", "_"))), None)
        if tiny is not None:
            args.model = str(_TINY_MODELS[tiny][0](work / tiny))
        ops = _checked_ops(args.model)
        atol, rtol = tolerance(args.dtype, ops)
        report: dict[str, Any] = {
            "model": tiny or args.model,
            "dtype": args.dtype,
            "atol": atol,
            "rtol": rtol,
            "modes": {},
        }
        (work / "prompts.json").write_text(json.dumps(_prompts(args.model, args.requests, args.prompt_len)))
        for mode in args.modes.split(","):
            if "fp8_linear" in ops:
                report["modes"][mode] = _check_fp8(args, mode, work, ops)
                report["vllm_version"] = report["modes"][mode].pop("vllm_version")
                continue
            alone = _run(args, mode, False, work, None)
            (work / "score.json").write_text(json.dumps(alone["scored"]))
            bridged = _run(args, mode, True, work, work / "score.json")
            report["modes"][mode] = {
                **compare(alone, bridged, atol, rtol, ops),
                "exits": {"alone": alone["exit"], "bridged": bridged["exit"]},
            }
            report["vllm_version"] = alone["vllm_version"]
    report["ok"] = all(m["ok"] for m in report["modes"].values())
    if args.json:
        print(json.dumps(report))
    else:
        for mode, m in report["modes"].items():
            print(
                f"{mode}: {'PASS' if m['ok'] else 'FAIL'}  worst |diff|/tol prefill {m['worst_prefill']:.3g}, decode "
                f"{m['worst_decode']:.3g}; {m['equal_requests']}/{m['requests']} requests' greedy ids equal; "
                f"near-ties {[(d['request'], d['step'], round(d['gap'], 5)) for d in m['divergences']]}; calls {m['calls']}"
            )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
