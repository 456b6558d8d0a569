"""Offline throughput of the engine (``LLM.generate``) beside ``transformers`` and, optionally, vLLM, in one run.

One run builds (or takes with ``--model``) a random-weight Llama checkpoint saved with
``transformers``, draws the workload's prompts (random token ids, seeded), and runs the same
requests, greedy with EOS ignored, through:

- ``engine``: this project's ``LLM.generate`` on the selected platform;
- ``transformers``: ``generate`` on the same weights, all requests in one batch (equal prompt
  lengths, so no padding), greedy, ``min_new_tokens = max_new_tokens``;
- ``vllm`` and ``vllm-all-cores`` (with ``--vllm-python``): ``dev/vllm_peer.py`` in vLLM's own
  interpreter, once as vLLM configures itself and once with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``
  (on CPU vLLM keeps a core for its scheduler by default).

Each reports output tokens per second (every request's output tokens over the wall time of the
whole ``generate`` call) and the time to first token: the wall time of the same requests with one
output token (every request's first token: the whole batch's prefill), and for the engine also the
mean per-request time to first token inside the full run (from ``LLM.stream``).

The default shape is the CPU workload of issue 13: hidden 512, 8 layers, 8 heads over 4 KV heads,
vocabulary 32000, intermediate 1536 (Llama's SwiGLU rule: 8/3 of hidden, rounded up to a multiple
of 256), 64 requests of 128 prompt and 128 output tokens. ``--h200`` switches to the GPU workload:
Llama-3-8B's shape in bf16, 256 requests of 512 prompt / 256 output tokens, plus batch-1 and
batch-64 decode rates with their memory-bandwidth utilisation (weight + KV bytes per step over a
copy bandwidth measured in the same run).
"""

from __future__ import annotations

import json
import os
import platform as host_platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ._decode import decode_rate, time_decode, warm_up

__all__ = ["CPU_WORKLOAD", "H200_WORKLOAD", "Workload", "build_model", "main", "make_prompts", "run"]

#: Where ``dev/vllm_peer.py`` lives in a checkout (the peer is not part of the installed package).
PEER_SCRIPT = Path(__file__).resolve().parents[4] / "dev" / "vllm_peer.py"


@dataclass(frozen=True)
class Workload:
    """A model shape and an offline workload (every number a flag of ``vllm-port bench engine``)."""

    hidden_size: int = 512
    intermediate_size: int = 1536
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 32000
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    num_requests: int = 64
    prompt_len: int = 128
    output_len: int = 128
    dtype: str = "float32"
    #: batch sizes of the decode-rate measurement (the H200 workload); empty: none
    decode_batches: tuple[int, ...] = ()


CPU_WORKLOAD = Workload()
H200_WORKLOAD = Workload(
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    num_requests=256,
    prompt_len=512,
    output_len=256,
    dtype="bfloat16",
    decode_batches=(1, 64),
)


def build_model(path: str | os.PathLike[str], w: Workload, seed: int = 0, device: str = "cpu") -> Path:
    """Save a random-weight ``LlamaForCausalLM`` of ``w``'s shape and dtype with ``save_pretrained`` (safetensors).

    Weights keep the ``transformers`` initialisation (normal, std 0.02): like a trained model's
    scale, so activations stay finite in bf16 through many layers. No tokenizer is saved: prompts
    are token ids.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=w.vocab_size,
        hidden_size=w.hidden_size,
        intermediate_size=w.intermediate_size,
        num_hidden_layers=w.num_layers,
        num_attention_heads=w.num_heads,
        num_key_value_heads=w.num_kv_heads,
        max_position_embeddings=w.max_position_embeddings,
        rope_theta=w.rope_theta,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    dtype = getattr(torch, w.dtype)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.config.dtype = dtype  # the checkpoint's dtype in config.json
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


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
            return flat_step(FlatModel(runner.model, runner.runtime))

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
        warm_up(llm, prompts)
        timing = time_decode(llm, prompts, w.output_len, whole_run=stream)
        elapsed = timing.total_s
        return {
            "output_tok_s": _rate(tokens, elapsed),
            "elapsed_s": elapsed,
            "output_tokens": tokens,
            "ttft_batch_s": timing.prefill_s,
            "ttft_mean_s": sum(first_token.values()) / max(len(first_token), 1),
            "platform": llm.runtime.platform.name,
            "provider_per_op": llm.provider_per_op,
            "captured_batch_sizes": llm.captured_batch_sizes,
            "tensor_parallel_size": llm_kwargs.get("tensor_parallel_size", 1),
        }
    finally:
        llm.close()


def run_transformers(model_dir: Path, prompts: list[list[int]], w: Workload, device: str) -> dict[str, Any]:
    """``transformers`` ``generate`` on the same weights: all prompts in one batch, greedy, no early stop."""
    from transformers import LlamaForCausalLM

    dtype = getattr(torch, w.dtype)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)

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
            )
        if device != "cpu":
            torch.accelerator.synchronize()
        assert out.shape[1] == w.prompt_len + n, out.shape
        return time.perf_counter() - start

    generate(2)  # warm-up
    batch_ttft = generate(1)
    elapsed = generate(w.output_len)
    tokens = len(prompts) * w.output_len
    return {
        "output_tok_s": _rate(tokens, elapsed),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "ttft_batch_s": batch_ttft,
    }


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


def _decode_rates(
    model_dir: Path, w: Workload, device: str | None, step: str, **llm_kwargs: Any
) -> list[dict[str, Any]]:
    """Decode tok/s at each of ``w.decode_batches`` with its memory-bandwidth utilisation.

    Decode time is the run's wall time minus the one-token run's (the prefill); the bytes of a
    step are every weight but the embedding table plus the KV cache the step reads (the mean
    context over the decode), counted against a device copy measured now.
    """
    from ._timing import copy_bandwidth_gbs

    rows = []
    for batch in w.decode_batches:
        wb = replace(w, num_requests=batch)
        res = run_engine(model_dir, make_prompts(wb, seed=1), wb, device, step, **llm_kwargs)
        rate = decode_rate(batch, w.output_len, res["elapsed_s"] - res["ttft_batch_s"])
        step_s = rate["step_ms"] / 1e3
        kv_token_bytes = 2 * w.num_layers * w.num_kv_heads * (w.hidden_size // w.num_heads) * _itemsize(w.dtype)
        mean_context = w.prompt_len + w.output_len / 2
        step_bytes = _weight_bytes(w) + batch * mean_context * kv_token_bytes
        # tensor parallel: each rank reads its shard of the layers and KV, and the whole replicated LM head
        ranks = llm_kwargs.get("tensor_parallel_size", 1)
        head_bytes = w.vocab_size * w.hidden_size * _itemsize(w.dtype)
        rank_bytes = (step_bytes - head_bytes) / ranks + head_bytes
        rows.append(
            {
                "batch": batch,
                **rate,
                "step_bytes": step_bytes,
                "achieved_gbs": step_bytes / step_s / 1e9,
                "devices": ranks,
                "device_step_bytes": rank_bytes,
                "device_gbs": rank_bytes / step_s / 1e9,
            }
        )
    dev = torch.device(device if device and device != "auto" else (_accelerator_type() or "cpu"))
    bandwidth = copy_bandwidth_gbs(dev, 1 << 30 if dev.type != "cpu" else 256 << 20)
    for row in rows:
        row["copy_gbs"] = bandwidth
        row["bandwidth_utilisation"] = row["device_gbs"] / bandwidth  # of one device's copy bandwidth
    return rows


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _weight_bytes(w: Workload) -> int:
    """Bytes of every weight a decode step reads: all but the embedding table (the LM head included)."""
    head = w.hidden_size // w.num_heads
    attn = w.hidden_size * (w.num_heads + 2 * w.num_kv_heads) * head + w.num_heads * head * w.hidden_size
    mlp = 3 * w.hidden_size * w.intermediate_size
    per_layer = attn + mlp + 2 * w.hidden_size
    return (w.num_layers * per_layer + w.hidden_size + w.vocab_size * w.hidden_size) * _itemsize(w.dtype)


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
) -> dict[str, Any]:
    """Run the workload through every system asked for; return the results (what ``--json`` writes).

    ``save_model``: build the model into this directory unless it already holds one (kept for later runs).
    """
    with tempfile.TemporaryDirectory(prefix="vllm-port-bench-engine-") as tmp:
        if model_dir is None and save_model is not None:
            model_dir = save_model
            if not (Path(save_model) / "config.json").is_file():
                build_model(Path(save_model), w, seed, build_device(device))
        if model_dir is None:
            model_dir = str(build_model(Path(tmp) / "model", w, seed, build_device(device)))
        prompts = make_prompts(w, seed)
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        results: dict[str, Any] = {}
        load_before = os.getloadavg()[0]
        kw: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size} if tensor_parallel_size > 1 else {}
        if enforce_eager:
            kw["enforce_eager"] = True
        if "engine" in systems:
            results["engine"] = run_engine(Path(model_dir), prompts, w, device, step, **kw)
        if vllm_python and "vllm" in systems:
            results["vllm"] = run_vllm(vllm_python, Path(model_dir), prompts_file, w, reserve_none=False)
            results["vllm-all-cores"] = run_vllm(vllm_python, Path(model_dir), prompts_file, w, reserve_none=True)
        if "transformers" in systems:
            results["transformers"] = run_transformers(
                Path(model_dir), prompts, w, "cuda" if _on_gpu(device) else "cpu"
            )
        decode = _decode_rates(Path(model_dir), w, device, step, **kw) if w.decode_batches else []
    vllm_rates = [
        results[k]["output_tok_s"] for k in ("vllm", "vllm-all-cores") if "output_tok_s" in results.get(k, {})
    ]
    ratio = results["engine"]["output_tok_s"] / max(vllm_rates) if vllm_rates and "engine" in results else None
    return {
        "workload": asdict(w),
        "model_dir": model_dir
        if model_dir and not model_dir.startswith(tempfile.gettempdir())
        else "(built, temporary)",
        "step": step,
        "results": results,
        "decode": decode,
        "engine_over_best_vllm": ratio,
        "machine": {"cpu": _cpu_model(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "versions": _versions(),
    }


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


def render(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    w = result["workload"]
    lines = [
        f"{w['num_requests']} requests x {w['prompt_len']} prompt / {w['output_len']} output tokens, greedy, "
        f"{w['dtype']}; hidden {w['hidden_size']}, {w['num_layers']} layers, {w['num_heads']}/{w['num_kv_heads']} "
        f"heads, intermediate {w['intermediate_size']}, vocab {w['vocab_size']}",
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
            f"replay captured graphs at {len(sizes)} batch sizes ({sizes[0]}..{sizes[-1]})" if sizes else "run eagerly"
        )
        lines.append(f"\nengine: decode steps {how}; tensor parallel size {engine['tensor_parallel_size']}")
    if result["engine_over_best_vllm"] is not None:
        lines.append(f"\nengine / faster vLLM configuration: {result['engine_over_best_vllm']:.2f}x")
    if result["decode"]:
        lines += [
            "",
            "| batch | decode tok/s | step (ms) | GB/s, all devices | GB/s per device | copy GB/s | utilisation |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for d in result["decode"]:
            lines.append(
                f"| {d['batch']} | {d['decode_tok_s']:,.0f} | {d['step_ms']:.2f} | {d['achieved_gbs']:.0f} | "
                f"{d.get('device_gbs', d['achieved_gbs']):.0f} | {d['copy_gbs']:.0f} | {d['bandwidth_utilisation']:.0%} |"
            )
    lines.append(
        f"\nload average before/after: {result['load_average_before']:.2f} / {result['load_average_after']:.2f}"
    )
    return "\n".join(lines)


def main(args: Any) -> int:
    """``vllm-port bench engine``: run, print the table, write ``--json``. Returns the exit status."""
    base = H200_WORKLOAD if args.h200 else CPU_WORKLOAD
    overrides = {
        k: getattr(args, k)
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "vocab_size",
            "num_requests",
            "prompt_len",
            "output_len",
            "dtype",
        )
        if getattr(args, k, None) is not None
    }
    if args.decode_batches is not None:
        overrides["decode_batches"] = tuple(int(b) for b in args.decode_batches.split(",") if b)
    w = replace(base, **overrides)
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = tuple(args.systems.split(","))
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
    )
    result["command"] = " ".join(["vllm-port", *sys.argv[1:]])
    print(render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
