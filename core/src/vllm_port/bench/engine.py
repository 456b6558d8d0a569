"""Offline throughput of the engine (``LLM.generate``) beside ``transformers`` and, optionally, vLLM, in one run.

One run builds (or takes with ``--model``) a random-weight checkpoint saved with ``transformers``
(a Llama; a Qwen3-MoE with ``--shape qwen3-30b-a3b``), draws the workload's prompts (random token ids, seeded), and runs the same
requests, greedy with EOS ignored, through:

- ``engine``: this project's ``LLM.generate`` on the selected platform;
- ``transformers``: ``generate`` on the same weights, all requests in one batch (equal prompt
  lengths, so no padding), greedy, ``min_new_tokens = max_new_tokens``;
- ``transformers-compiled``: the same with a static cache and its decode step under
  ``torch.compile(mode="reduce-overhead")`` (compiler and CUDA graphs: ``transformers``' own automatic
  compilation, which it applies on accelerators; on CPU the static cache alone), the plain-torch decoder
  a compiler makes of the model; its compilation happens in the warm-up, outside the timed runs;
- ``vllm`` and ``vllm-all-cores`` (with ``--vllm-python``): ``dev/vllm_peer.py`` in vLLM's own
  interpreter, once as vLLM configures itself and once with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``
  (on CPU vLLM keeps a core for its scheduler by default).

Each reports output tokens per second (every request's output tokens over the wall time of the
whole ``generate`` call) and the time to first token: the wall time of the same requests with one
output token (every request's first token: the whole batch's prefill), and for the engine also the
mean per-request time to first token inside the full run (from ``LLM.stream``). Every system runs both
once untimed before it times them (the engine's times are ``rehearsal_s`` in its result), so first use
(kernel compiles, allocations) is on no one's clock.

The default shape is the CPU workload of issue 13: hidden 512, 8 layers, 8 heads over 4 KV heads,
vocabulary 32000, intermediate 1536 (Llama's SwiGLU rule: 8/3 of hidden, rounded up to a multiple
of 256), 64 requests of 128 prompt and 128 output tokens. ``--h200`` switches to the GPU workload:
Llama-3-8B's shape in bf16, 256 requests of 512 prompt / 256 output tokens, plus batch-1 and
batch-64 decode rates with their memory-bandwidth utilisation (weight + KV bytes per step over a
copy bandwidth measured in the same run).

``--shape`` names a preset of :data:`~.engine_workload.SHAPES`: ``llama3-8b`` (the ``--h200``
workload) or ``qwen3-30b-a3b`` (Qwen3-30B-A3B's shape, a random ``Qwen3MoeForCausalLM``, 8 of its 48
layers unless ``--layers`` says otherwise; a decode step's bytes count only the experts a step is
expected to hit under uniform routing, :func:`~.engine_workload.expected_experts`). ``--weights``
lists the checkpoints to run the engine on, e.g. ``bf16,fp8``: the float one and the same weights
with the decoder projections in float8 (per-output-channel scales), each built and run in turn in
the same process, and the fp8 / float decode-rate ratio at each batch printed. ``transformers`` and
vLLM run the float checkpoint only.
"""

from __future__ import annotations

import json
import os
import platform as host_platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ._decode import decode_rate, time_decode
from .engine_workload import (
    CPU_WORKLOAD,
    FAMILIES,
    H200_WORKLOAD,
    QWEN3_30B_A3B_WORKLOAD,
    SHAPES,
    Workload,
    build_model,
    expected_experts,
    itemsize,
    kv_token_bytes,
    release_memory,
    step_weight_bytes,
    weights_label,
)
from .mixed_load import render as render_mixed
from .mixed_load import run_mixed

__all__ = [
    "CPU_WORKLOAD",
    "FLOAT_WEIGHTS",
    "H200_WORKLOAD",
    "QWEN3_30B_A3B_WORKLOAD",
    "ROUTING_ASSUMPTION",
    "SHAPES",
    "SYSTEMS",
    "FlagError",
    "Workload",
    "build_model",
    "main",
    "make_prompts",
    "resolve_flags",
    "run",
]

#: Where ``dev/vllm_peer.py`` lives in a checkout (the peer is not part of the installed package).
PEER_SCRIPT = Path(__file__).resolve().parents[4] / "dev" / "vllm_peer.py"


def make_prompts(w: Workload, seed: int = 0) -> list[list[int]]:
    """``num_requests`` prompts of ``prompt_len`` random token ids (ids 3 and up: no BOS/EOS), reproducible."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, w.vocab_size, (w.num_requests, w.prompt_len), generator=g).tolist()


def _rate(num_tokens: int, seconds: float) -> float:
    return num_tokens / seconds if seconds > 0 else float("nan")


def run_engine(
    model_dir: Path, prompts: list[list[int]], w: Workload, device: str | None, step: str = "eager", **llm_kwargs: Any
) -> dict[str, Any]:
    """The engine on ``prompts``: output tok/s of the whole run, batch and per-request time to first token."""
    from ..engine import LLM

    make_step = None
    if step == "flat":
        from ..engine.runner import flat_step
        from ..flat import FlatModel

        def make_step(runner: Any) -> Any:
            return flat_step(FlatModel(runner.model, runner.runtime, block_size=runner.block_size))

    llm = LLM(
        str(model_dir),
        device=device or "auto",
        dtype=w.dtype,
        max_model_len=w.prompt_len + w.output_len,
        max_num_seqs=max(w.num_requests, 1),
        enable_prefix_caching=False,  # random prompts share nothing; keep the hashing out of the timing
        seed=0,
        **({"make_step": make_step} if make_step is not None else {}),
        **llm_kwargs,
    )
    first_token: dict[int, float] = {}
    tokens = 0

    def stream(prompts: list[list[int]], params: Any) -> None:
        """The whole run, streamed: each request's first token timed, every output token counted."""
        nonlocal tokens
        start = time.perf_counter()
        for delta in llm.stream(prompts, params):
            first_token.setdefault(delta.index, time.perf_counter() - start)
            tokens += len(delta.token_ids)

    try:
        # the timed runs once, untimed: the whole run's mixed steps carry every count of decode rows from a few to
        # the batch, and give the attention kernels arguments a short warm-up's one mixed step did not (most likely
        # compiled on first use). On an H100 the first whole run took 11.6 s, the next one 7.2.
        rehearsal = time_decode(llm, prompts, w.output_len)
        timing = time_decode(llm, prompts, w.output_len, whole_run=stream)
        elapsed = timing.total_s
        return {
            "output_tok_s": _rate(tokens, elapsed),
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "ttft_batch_s": timing.prefill_s,
            "rehearsal_s": {"one_token_run": rehearsal.prefill_s, "whole_run": rehearsal.total_s},
            "ttft_mean_s": sum(first_token.values()) / max(len(first_token), 1),
            "platform": llm.runtime.platform.name,
            "provider_per_op": llm.provider_per_op,
            "captured_batch_sizes": llm.captured_batch_sizes,
            "tensor_parallel_size": llm_kwargs.get("tensor_parallel_size", 1),
            "async_scheduling": llm.runs_ahead,
        }
    finally:
        llm.close()


def _progress(name: str, res: dict[str, Any]) -> None:
    """One line on stderr as each timed run finishes: a run cut short by a timeout still leaves its numbers."""
    if "error" in res:
        said = f"error: {res['error']}"
    elif "itl_p50_ms" in res:
        said = f"{res['output_tok_s']:,.0f} output tok/s, ITL p50 {res['itl_p50_ms']:.2f} ms, p99 {res['itl_p99_ms']:.2f} ms"
    elif "decode_tok_s" in res:
        said = f"decode {res['decode_tok_s']:,.0f} tok/s, {res['step_ms']:.2f} ms a step"
    else:
        said = f"{res['output_tok_s']:,.0f} output tok/s, all first tokens {res['ttft_batch_s']:.3f} s"
        if "rehearsal_s" in res:  # the same runs untimed before, first use and all
            said += ", untimed rehearsal before: {one_token_run:.3f} s and {whole_run:.3f} s".format(
                **res["rehearsal_s"]
            )
    print(f"[bench engine, {time.strftime('%H:%M:%S')}] {name}: {said}", file=sys.stderr, flush=True)


def _peer_result(name: str, run: Callable[[], dict[str, Any]], device: str) -> dict[str, Any]:
    """``run()``'s result, or ``{"error": ...}`` naming what went wrong: a peer that fails (a compiler's error, out
    of memory) is reported in the table, its memory on ``device`` is given back, and the systems that ran keep
    their numbers."""
    try:
        return run()
    except Exception as exc:  # the message goes into the results table
        print(f"{name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        release_memory(device)
        return {"error": f"{type(exc).__name__}: {exc}"}


def run_transformers(
    model_dir: Path, prompts: list[list[int]], w: Workload, device: str, compiled: bool = False
) -> dict[str, Any]:
    """``transformers`` ``generate`` on the same weights: all prompts in one batch, greedy, no early stop.

    The model class is the one ``config.json`` names (``AutoModelForCausalLM``); a mixture-of-experts
    model runs ``transformers``' default experts implementation, which the result names. ``compiled``: a
    static cache, whose decode step ``transformers`` compiles (``CompileConfig(mode="reduce-overhead")``)
    on an accelerator; both timed runs run once untimed first, so every compilation is behind them.
    """
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, w.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    extra: dict[str, Any] = {}
    if compiled:
        from transformers import CompileConfig

        extra = {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead")}

    def generate(n: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
                **extra,
            )
        if device != "cpu":
            torch.accelerator.synchronize()
        assert out.shape[1] == w.prompt_len + n, out.shape
        return time.perf_counter() - start

    # the timed runs once untimed, as the engine's rehearsal: first use, and a static cache's compilation for the
    # output length, happen here
    generate(1)
    generate(w.output_len)
    batch_ttft = generate(1)
    elapsed = generate(w.output_len)
    tokens = len(prompts) * w.output_len
    result = {
        "output_tok_s": _rate(tokens, elapsed),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "ttft_batch_s": batch_ttft,
    }
    if compiled:
        result["compiled"] = device != "cpu"  # transformers compiles its static-cache step on accelerators only
    if w.is_moe:
        result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    return result


def run_vllm(python: str, model_dir: Path, prompts_file: Path, w: Workload, reserve_none: bool) -> dict[str, Any]:
    """``dev/vllm_peer.py`` in vLLM's interpreter (its own venv); its one JSON line, or the error."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if reserve_none:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    cmd = [
        python,
        str(PEER_SCRIPT),
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        "--output-len",
        str(w.output_len),
        "--dtype",
        w.dtype,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)  # noqa: S603 - our peer script
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"error": f"{' '.join(cmd)} exited {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


#: What the bytes of a mixture-of-experts decode row assume (said in each such row of the JSON).
ROUTING_ASSUMPTION = (
    "uniform routing: each token takes num_experts_per_tok = k of the num_experts = E experts, every expert "
    "equally likely and tokens independent, so a decode step of B tokens reads E*(1-(1-k/E)^B) distinct "
    "experts per layer"
)


def _decode_rates(
    model_dir: Path, w: Workload, device: str | None, step: str, copy_gbs: float | None = None, **llm_kwargs: Any
) -> list[dict[str, Any]]:
    """Decode tok/s at each of ``w.decode_batches`` with its memory-bandwidth utilisation.

    Decode time is the run's wall time minus the one-token run's (the prefill); the bytes of a
    step are every weight but the embedding table (:func:`~.engine_workload.step_weight_bytes`: an
    fp8 projection one byte a weight plus its scales; of a MoE layer the router and only the experts
    the step is expected to hit, :data:`ROUTING_ASSUMPTION`) plus the KV cache the step reads (the
    mean context over the decode), counted against a device copy measured now (or ``copy_gbs``,
    measured by an earlier call of the same run).
    """
    from ._timing import copy_bandwidth_gbs

    rows = []
    for batch in w.decode_batches:
        wb = replace(w, num_requests=batch)
        res = run_engine(model_dir, make_prompts(wb, seed=1), wb, device, step, **llm_kwargs)
        rate = decode_rate(batch, w.output_len, res["elapsed_s"] - res["ttft_batch_s"])
        step_s = rate["step_ms"] / 1e3
        mean_context = w.prompt_len + w.output_len / 2
        experts = expected_experts(w, batch) if w.is_moe else None
        kv_bytes = kv_token_bytes(w, llm_kwargs.get("kv_cache_dtype", "auto"))
        step_bytes = step_weight_bytes(w, experts) + batch * mean_context * kv_bytes
        # tensor parallel: each rank reads its shard of the layers and KV, and the whole replicated LM head
        ranks = llm_kwargs.get("tensor_parallel_size", 1)
        head_bytes = w.vocab_size * w.hidden_size * itemsize(w.dtype)
        rank_bytes = (step_bytes - head_bytes) / ranks + head_bytes
        row = {
            "batch": batch,
            "weights": weights_label(w),
            **rate,
            "step_bytes": step_bytes,
            "achieved_gbs": step_bytes / step_s / 1e9,
            "devices": ranks,
            "device_step_bytes": rank_bytes,
            "device_gbs": rank_bytes / step_s / 1e9,
        }
        if experts is not None:
            row.update(experts_read_per_layer=experts, routing=ROUTING_ASSUMPTION)
        rows.append(row)
        _progress(f"batch {batch} ({weights_label(w)})", row)
    if copy_gbs is None:
        dev = torch.device(device if device and device != "auto" else (_accelerator_type() or "cpu"))
        copy_gbs = copy_bandwidth_gbs(dev, 1 << 30 if dev.type != "cpu" else 256 << 20)
    for row in rows:
        row["copy_gbs"] = copy_gbs
        row["bandwidth_utilisation"] = row["device_gbs"] / copy_gbs  # of one device's copy bandwidth
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return host_platform.processor() or "unknown"


def _versions() -> dict[str, str]:
    import transformers

    import vllm_port

    return {
        "python": host_platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm_port": getattr(vllm_port, "__version__", "?"),
    }


class FlagError(ValueError):
    """A flag of ``vllm-port bench engine`` that cannot be run as given (the message names the flag)."""


#: ``--weights`` names of a float checkpoint -> the dtype it is stored (and run) in.
FLOAT_WEIGHTS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: The systems ``--systems`` may list.
SYSTEMS = ("engine", "transformers", "transformers-compiled", "vllm")


def _checkpoint(
    w: Workload, model_dir: str | None, save_model: str | None, tmp: Path, seed: int, device: str | None
) -> str:
    """The directory of ``w``'s checkpoint: ``model_dir`` as given; else ``save_model`` (``save_model-fp8`` for fp8
    weights), built unless it holds one already, which must be of ``w``'s family, size and weights; else built in ``tmp``.
    """
    if model_dir is not None:
        return model_dir
    suffix = "-fp8" if w.weights == "fp8" else ""
    if save_model is None:
        return str(build_model(tmp / f"model{suffix}", w, seed, build_device(device)))
    path = Path(save_model)
    path = path.with_name(path.name + suffix)  # beside it, whether or not the flag ends in a slash
    if not (path / "config.json").is_file():
        build_model(path, w, seed, build_device(device))
        return str(path)
    config = json.loads((path / "config.json").read_text())
    saved = (
        (config.get("architectures") or ["?"])[0],
        config.get("num_hidden_layers"),
        config.get("hidden_size"),
        "fp8" if "quantization_config" in config else "float",
    )
    wanted = (FAMILIES[w.family], w.num_layers, w.hidden_size, w.weights)
    if saved != wanted:
        raise FlagError(
            f"--save-model: {path} holds a {saved[3]} {saved[0]} of {saved[1]} layers, hidden {saved[2]}; this run "
            f"builds a {wanted[3]} {wanted[0]} of {wanted[1]} layers, hidden {wanted[2]}: pass another directory"
        )
    return str(path)


def run(
    w: Workload,
    model_dir: str | None = None,
    device: str | None = None,
    vllm_python: str | None = None,
    systems: tuple[str, ...] = ("engine", "transformers", "vllm"),
    step: str = "eager",
    seed: int = 0,
    tensor_parallel_size: int = 1,
    enforce_eager: bool = False,
    save_model: str | None = None,
    weights: Sequence[str] | None = None,
    async_scheduling: bool | None = None,
    mixed_requests: int = 0,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Run the workload through every system asked for; return the results (what ``--json`` writes).

    ``weights``: the checkpoints to run, keys of :data:`~.engine_workload.WEIGHTS` (default: ``w.weights``
    alone), each built (or ``model_dir``, when there is one) and run in turn with the same prompts;
    ``transformers`` and vLLM run the float one only. Results of the fp8 checkpoint are keyed
    ``"engine (fp8)"``; with float and fp8 weights, ``fp8_over_float_decode`` holds their decode-rate ratios.
    ``save_model``: build the model into this directory unless it already holds one (kept for later
    runs); the fp8 checkpoint goes to ``save_model + "-fp8"``. ``mixed_requests``: also run the engine on
    a mixed workload of that many requests (:mod:`.mixed_load`), results under ``"mixed"``. ``kv_cache_dtype``:
    the engine's cache (``LLM(kv_cache_dtype=...)``), counted at its size in the decode rows' bytes.

    :raises FlagError: for a ``save_model`` directory that holds another model.
    """
    variants = [replace(w, weights=v) for v in (weights or (w.weights,))]
    if model_dir is not None and len(variants) > 1:
        raise FlagError(f"--model is one checkpoint; --weights lists {len(variants)}: drop --model or list one")
    with tempfile.TemporaryDirectory(prefix="vllm-port-bench-engine-") as tmp:
        dirs = {v.weights: _checkpoint(v, model_dir, save_model, Path(tmp), seed, device) for v in variants}
        prompts = make_prompts(w, seed)
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        results: dict[str, Any] = {}
        decode: list[dict[str, Any]] = []
        mixed: dict[str, Any] | None = None
        load_before = os.getloadavg()[0]
        kw: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
        if enforce_eager:
            kw["enforce_eager"] = True
        if async_scheduling is not None:  # None: the engine's default (ahead on one accelerator)
            kw["async_scheduling"] = async_scheduling
        if kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = kv_cache_dtype
        copy_gbs = None
        for v in variants:
            path = Path(dirs[v.weights])
            tag = "" if v.weights == "float" else f" ({weights_label(v)})"
            if "engine" in systems:
                results["engine" + tag] = run_engine(path, prompts, v, device, step, **kw)
                _progress("engine" + tag, results["engine" + tag])
            if v.weights == "float" and vllm_python and "vllm" in systems:
                results["vllm"] = run_vllm(vllm_python, path, prompts_file, v, reserve_none=False)
                results["vllm-all-cores"] = run_vllm(vllm_python, path, prompts_file, v, reserve_none=True)
            for name in ("transformers", "transformers-compiled"):
                if v.weights == "float" and name in systems:
                    where = "cuda" if _on_gpu(device) else "cpu"
                    run = partial(run_transformers, path, prompts, v, where, compiled=name != "transformers")
                    results[name] = _peer_result(name, run, where)
                    _progress(name, results[name])
            if v.decode_batches:
                decode += _decode_rates(path, v, device, step, copy_gbs, **kw)
                copy_gbs = decode[-1]["copy_gbs"]
            if mixed_requests and v.weights == "float" and "engine" in systems:
                mixed = run_mixed(
                    path, v.vocab_size, v.dtype, mixed_requests, v.prompt_len, v.output_len, device, seed, **kw
                )
                for name, timed in mixed["runs"].items():
                    _progress(f"mixed, {name}", timed)
    vllm_rates = [
        results[k]["output_tok_s"] for k in ("vllm", "vllm-all-cores") if "output_tok_s" in results.get(k, {})
    ]
    ratio = results["engine"]["output_tok_s"] / max(vllm_rates) if vllm_rates and "engine" in results else None
    result = {
        "workload": asdict(variants[0]),
        "model_dir": _shown(dirs[variants[0].weights]),
        "step": step,
        "kv_cache_dtype": kv_cache_dtype,
        "results": results,
        "decode": decode,
        "mixed": mixed,
        "engine_over_best_vllm": ratio,
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "versions": _versions(),
    }
    if len(variants) > 1:
        result["weights"] = [weights_label(v) for v in variants]
        result["model_dirs"] = {weights_label(v): _shown(dirs[v.weights]) for v in variants}
        result["fp8_over_float_decode"] = _fp8_ratios(decode)
    return result


def _shown(model_dir: str) -> str:
    """A model directory as the results name it: a temporary one is gone after the run."""
    return model_dir if not model_dir.startswith(tempfile.gettempdir()) else "(built, temporary)"


def _fp8_ratios(decode: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """fp8 over float decode tok/s at each batch size both were run at."""
    by_weights: dict[str, dict[int, float]] = {}
    for row in decode:
        kind = "fp8" if row["weights"] == "fp8" else "float"
        by_weights.setdefault(kind, {})[row["batch"]] = row["decode_tok_s"]
    fp8, base = by_weights.get("fp8", {}), by_weights.get("float", {})
    return [
        {"batch": b, "fp8_tok_s": fp8[b], "float_tok_s": base[b], "ratio": fp8[b] / base[b]} for b in fp8 if b in base
    ]


def _accelerator_type() -> str | None:
    """The device type of torch's current accelerator (``"cuda"``, ``"xpu"``, ...), or ``None``."""
    return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None


def build_device(device: str | None) -> str:
    """Where to build a random checkpoint: the accelerator when the run is on one (fast init), else the CPU."""
    return (_accelerator_type() or "cpu") if _on_gpu(device) else "cpu"


def _on_gpu(device: str | None) -> bool:
    if device in (None, "auto"):
        return _accelerator_type() is not None
    return device not in ("cpu",)


def _header(w: dict[str, Any]) -> str:
    """The workload in one line: requests, tokens, dtype and the model's shape (a preset's layers said against its model's)."""
    preset = SHAPES.get(w.get("shape", ""))
    requests = f"{w['num_requests']} requests"
    if preset is not None and w["num_requests"] < preset.workload.num_requests:
        requests += f" (the {w['shape']} preset's {preset.workload.num_requests} cut to keep the run short)"
    elif preset is not None and w["num_requests"] > preset.workload.num_requests:
        requests += f" (the {w['shape']} preset has {preset.workload.num_requests})"
    layers = f"{w['num_layers']} layers"
    if preset is not None and w["num_layers"] < preset.model_layers:
        layers = f"{w['num_layers']} of {preset.model}'s {preset.model_layers} layers"
    heads = f"{w['num_heads']}/{w['num_kv_heads']} heads"
    if w.get("head_dim") is not None:
        heads += f" of {w['head_dim']}"
    if w.get("family") == "qwen3_moe":
        renormalised = ", renormalised" if w["norm_topk_prob"] else ""
        mlp = (
            f"{w['num_experts']} experts of {w['moe_intermediate_size']} (top {w['num_experts_per_tok']}{renormalised})"
        )
    else:
        mlp = f"intermediate {w['intermediate_size']}"
    return (
        f"{requests} x {w['prompt_len']} prompt / {w['output_len']} output tokens, greedy, {w['dtype']}; "
        f"hidden {w['hidden_size']}, {layers}, {heads}, {mlp}, vocab {w['vocab_size']}"
    )


def _weights_note(result: dict[str, Any]) -> list[str]:
    """What an fp8 checkpoint holds and which systems ran it (nothing for a float-only run)."""
    w = result["workload"]
    labels = result.get("weights", ["fp8" if w.get("weights") == "fp8" else w["dtype"]])
    if "fp8" not in labels:
        return []
    dtype = w["dtype"]
    floats = [label for label in labels if label != "fp8"]
    lines = [
        f"\nfp8 weights: q/k/v/o and gate/up/down in float8_e4m3fn with one float32 scale per output channel "
        f"(compressed-tensors); embeddings, norms and LM head {dtype}",
        "fp8 rows: the engine alone (transformers is not needed for them"
        + (f"; it runs the {floats[0]} checkpoint)" if floats else ")"),
    ]
    for r in result.get("fp8_over_float_decode", []):
        lines.append(f"fp8 / {floats[0]} decode tok/s at batch {r['batch']}: {r['ratio']:.2f}x")
    return lines


def _decode_table(result: dict[str, Any]) -> list[str]:
    """The decode rows: a weights column when several checkpoints ran, an experts column for a MoE model."""
    several = len(result.get("weights", [])) > 1
    moe = any("experts_read_per_layer" in d for d in result["decode"])
    head = ["batch", *(["weights"] if several else []), "decode tok/s", "step (ms)"]
    head += [*(["experts read / layer"] if moe else []), "GB/s, all devices", "GB/s per device", "copy GB/s"]
    head.append("utilisation")
    lines = ["", "| " + " | ".join(head) + " |", "| " + " | ".join("---:" for _ in head) + " |"]
    for d in result["decode"]:
        cells = [str(d["batch"]), *([d["weights"]] if several else [])]
        cells += [f"{d['decode_tok_s']:,.0f}", f"{d['step_ms']:.2f}"]
        cells += [f"{d['experts_read_per_layer']:.1f}"] if moe else []
        cells += [f"{d['achieved_gbs']:.0f}", f"{d.get('device_gbs', d['achieved_gbs']):.0f}", f"{d['copy_gbs']:.0f}"]
        cells.append(f"{d['bandwidth_utilisation']:.0%}")
        lines.append("| " + " | ".join(cells) + " |")
    if moe:
        k, e = result["workload"]["num_experts_per_tok"], result["workload"]["num_experts"]
        lines.append(
            f"\nexperts read: each layer's expected distinct experts under uniform routing, E*(1-(1-k/E)^B) "
            f"with E = {e}, k = {k}, B = the batch"
        )
    return lines


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        _header(result["workload"]),
        "",
        "| system | output tok/s | TTFT, all first tokens (s) | mean TTFT in run (s) | wall (s) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in result["results"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} | | | |")
            continue
        mean = f"{r['ttft_mean_s']:.3f}" if r.get("ttft_mean_s") is not None else "-"
        lines.append(f"| {name} | {r['output_tok_s']:,.0f} | {r['ttft_batch_s']:.3f} | {mean} | {r['elapsed_s']:.2f} |")
    engine = result["results"].get("engine", {})
    if "captured_batch_sizes" in engine:
        sizes = engine["captured_batch_sizes"]
        how = (
            f"replay captured graphs at {len(sizes)} sizes ({sizes[0]}..{sizes[-1]} rows: sequences of a decode step, "
            "tokens of a prefill or mixed one)"
            if sizes
            else "run eagerly"
        )
        scheduling = "asynchronous" if engine.get("async_scheduling") else "synchronous"
        cache = "" if result.get("kv_cache_dtype", "auto") == "auto" else f"; KV cache {result['kv_cache_dtype']}"
        lines.append(
            f"\nengine: steps {how}; tensor parallel size {engine['tensor_parallel_size']}; {scheduling} scheduling"
            f"{cache}"
        )
    experts = result["results"].get("transformers", {}).get("experts_implementation")
    if experts:
        lines.append(f"transformers: experts implementation {experts!r}")
    if "compiled" in result["results"].get("transformers-compiled", {}):
        how = (
            "its decode step compiled (reduce-overhead: CUDA graphs)"
            if result["results"]["transformers-compiled"]["compiled"]
            else "not compiled on CPU"
        )
        lines.append(f"transformers-compiled: static cache, {how}")
    if result["engine_over_best_vllm"] is not None:
        lines.append(f"\nengine / faster vLLM configuration: {result['engine_over_best_vllm']:.2f}x")
    if result["decode"]:
        lines += _decode_table(result)
    if result.get("mixed"):
        lines += render_mixed(result["mixed"])
    lines += _weights_note(result)
    lines.append(
        f"\nload average before/after: {result['load_average_before']:.2f} / {result['load_average_after']:.2f}"
    )
    return "\n".join(lines)


_SIZE_FLAGS = {
    "hidden_size": "--hidden-size",
    "intermediate_size": "--intermediate-size",
    "num_layers": "--layers",
    "num_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "vocab_size": "--vocab-size",
    "num_requests": "--num-requests",
    "prompt_len": "--prompt-len",
    "output_len": "--output-len",
}
_MOE_FLAGS = {
    "num_experts": "--num-experts",
    "num_experts_per_tok": "--experts-per-tok",
    "moe_intermediate_size": "--moe-intermediate-size",
}


def resolve_flags(args: Any) -> tuple[Workload, tuple[str, ...], tuple[str, ...]]:
    """The workload, the checkpoints (keys of :data:`~.engine_workload.WEIGHTS`) and the systems that ``args`` ask for.

    :raises FlagError: for a flag, or a combination of flags, that cannot run, naming the flag.
    """
    shape = getattr(args, "shape", None)
    if args.h200 and shape not in (None, "llama3-8b"):
        raise FlagError(f"--h200 is --shape llama3-8b; it cannot go with --shape {shape}: drop one")
    base = SHAPES[shape].workload if shape else H200_WORKLOAD if args.h200 else CPU_WORKLOAD
    overrides: dict[str, Any] = {}
    for key, flag in {**_SIZE_FLAGS, **_MOE_FLAGS}.items():
        value = getattr(args, key, None)
        if value is None:
            continue
        if value <= 0:
            raise FlagError(f"{flag} must be positive, got {value}")
        if key in _MOE_FLAGS and not base.is_moe:
            raise FlagError(f"{flag} is for a mixture-of-experts shape (--shape qwen3-30b-a3b); this one is dense")
        overrides[key] = value
    if args.dtype is not None:
        overrides["dtype"] = args.dtype
    if args.decode_batches is not None:
        try:
            batches = tuple(int(b) for b in args.decode_batches.split(",") if b)
        except ValueError:
            batches = (0,)
        if any(b <= 0 for b in batches):
            raise FlagError(f"--decode-batches must be comma-separated positive integers, got {args.decode_batches!r}")
        overrides["decode_batches"] = batches
    weights = _resolve_weights(getattr(args, "weights", None), args.dtype, overrides)
    w = replace(base, **overrides, weights=weights[0])
    if w.is_moe and w.num_experts_per_tok > w.num_experts:
        raise FlagError(
            f"--experts-per-tok {w.num_experts_per_tok} is more than the {w.num_experts} experts (--num-experts)"
        )
    if "fp8" in weights and w.is_moe:
        raise FlagError(
            f"--weights fp8 needs a dense shape: the engine loads no FP8 mixture-of-experts checkpoint "
            f"(fused_moe takes float experts), and --shape {w.shape or 'qwen3-30b-a3b'} is one"
        )
    if "fp8" in weights and args.tensor_parallel_size > 1:
        raise FlagError("--weights fp8 runs on one device: the engine does not shard an FP8 checkpoint "
                        f"(--tensor-parallel-size {args.tensor_parallel_size})")  # fmt: skip
    if args.model is not None and len(weights) > 1:
        raise FlagError(f"--model is one checkpoint; --weights {args.weights} lists {len(weights)}: drop one")
    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown or not systems:
        raise FlagError(f"--systems {args.systems!r}: each must be one of {', '.join(SYSTEMS)}")
    if "float" not in weights and {"transformers", "transformers-compiled", "vllm"} & set(systems):
        raise FlagError(
            f"--systems {args.systems}: transformers and vLLM run a float checkpoint, and --weights {args.weights} "
            "lists none (add bf16, or run --systems engine)"
        )
    return w, weights, systems


def _resolve_weights(flag: str | None, dtype_flag: str | None, overrides: dict[str, Any]) -> tuple[str, ...]:
    """``--weights`` as keys of :data:`~.engine_workload.WEIGHTS`, float first; a float name sets the dtype."""
    if flag is None:
        return ("float",)
    names = [n for n in flag.split(",") if n]
    choices = [*FLOAT_WEIGHTS, "fp8"]
    unknown = [n for n in names if n not in choices]
    if unknown or not names or len(set(names)) != len(names):
        raise FlagError(f"--weights {flag!r}: a comma-separated list of distinct names of {', '.join(choices)}")
    floats = [n for n in names if n in FLOAT_WEIGHTS]
    if len(floats) > 1:
        raise FlagError(f"--weights {flag}: at most one float checkpoint (beside fp8), got {', '.join(floats)}")
    if floats:
        dtype = FLOAT_WEIGHTS[floats[0]]
        if dtype_flag is not None and dtype_flag != dtype:
            raise FlagError(
                f"--weights {floats[0]} and --dtype {dtype_flag} disagree: a float checkpoint is stored in the "
                "run's dtype (drop --dtype)"
            )
        overrides["dtype"] = dtype
    return tuple(["float"] * bool(floats) + ["fp8"] * ("fp8" in names))


def main(args: Any) -> int:
    """``vllm-port bench engine``: run, print the table, write ``--json``. Returns the exit status (2: bad flags)."""
    try:
        w, weights, systems = resolve_flags(args)
        mixed = getattr(args, "mixed_requests", 0)
        if mixed < 0:
            raise FlagError(f"--mixed-requests must be 0 (none) or positive, got {args.mixed_requests}")
        if mixed and (args.enforce_eager or args.tensor_parallel_size != 1):
            raise FlagError(
                "--mixed-requests compares prefill steps replayed from captured graphs with eager ones in one process: "
                "drop --enforce-eager and --tensor-parallel-size, or --mixed-requests"
            )
        if args.threads:
            torch.set_num_threads(args.threads)
        result = run(
            w,
            args.model,
            args.device,
            args.vllm_python,
            systems,
            args.step,
            args.seed,
            args.tensor_parallel_size,
            args.enforce_eager,
            args.save_model,
            weights,
            args.async_scheduling,
            getattr(args, "mixed_requests", 0),
            getattr(args, "kv_cache_dtype", "auto"),
        )
    except FlagError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result["command"] = " ".join(["vllm-port", *sys.argv[1:]])
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
