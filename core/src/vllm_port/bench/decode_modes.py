"""Decode-step time of a Llama-shaped model in every execution mode, beside ``transformers`` on the same weights.

One run builds a ``transformers`` ``LlamaForCausalLM`` with random weights (Llama-3-8B's shape on a
GPU, a small shape on CPU, ``--layers`` to cut the depth), builds the flat model from the very same
tensors, and times one decode step (one new token per sequence, every sequence with ``--context``
tokens in its cache) at each batch size in:

- ``eager``: the flat decode graph after the fusion passes, each node its bound provider;
- ``compiled``: ``torch.compile`` with the ``vllm_port`` backend (pieces by the platform's compiler);
- ``captured``: the eager graph captured per batch size with the platform's graph capture;
- ``compiled+captured``: the compiled step, captured;
- ``hf-eager``: ``transformers`` eager with its dynamic cache;
- ``hf-compiled``: ``transformers`` with a static cache under ``torch.compile`` (``mode="reduce-overhead"``
  on a GPU, which captures CUDA graphs; the default mode on CPU).

Memory-bandwidth utilisation is the bytes a step must read (every weight but the embedding table,
plus the KV cache) over the step time, against a device copy measured in the same run. Every mode
is set up (compiled, captured, warmed) before any is timed; then ``ROUNDS`` rounds time each mode
once in turn (``bench._timing.median_ms``: device events on a GPU, wall clock on CPU) and a row is
its median round, so load from other processes on a shared host falls on all modes alike.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import platform as host_platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._timing import copy_bandwidth_gbs, load_average, median_ms, synchronize

__all__ = ["MODES", "SHAPES", "main", "run"]

#: Model shapes: Llama-3-8B's, and a small one for CPU (the shape of the engine's CPU benchmark).
SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_theta=500000.0,
    ),
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=10000.0,
    ),
}
MODES = ("eager", "compiled", "captured", "compiled+captured", "hf-eager", "hf-compiled")
#: Timing rounds: each round times every mode once (a median of many calls); a row is the median round.
ROUNDS = 5
BLOCK_SIZE = 16


def _hf_model(shape: dict[str, Any], layers: int | None, context: int, dtype: torch.dtype, device: torch.device):
    import transformers

    config = transformers.LlamaConfig(
        **{**shape, **({"num_hidden_layers": layers} if layers else {})},
        architectures=["LlamaForCausalLM"],
        max_position_embeddings=max(8192, context),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in the run's dtype: no float32 copy of an 8B model first
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    return config, model


def _flat_model(hf_config: Any, hf_model: Any, dtype: torch.dtype) -> Any:
    from ..models import LlamaModel, load_config

    with tempfile.TemporaryDirectory() as tmp:
        hf_config.dtype = dtype  # what config.json records as the checkpoint's dtype
        hf_config.save_pretrained(tmp)
        config = load_config(tmp)
    weights = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    return LlamaModel(config, weights)


def _weight_bytes(model: Any) -> int:
    """Bytes of the weights one decode step reads: every layer, the final norm and the LM head (not the embedding)."""
    seen: set[int] = set()
    total = 0
    tensors = [t for layer in model.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    for t in [*tensors, model.final_norm, model.lm_head]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class _Decode:
    """Our side: paged KV caches holding ``context - 1`` tokens per sequence and the inputs of the next step."""

    def __init__(self, config: Any, batch: int, context: int, dtype: torch.dtype, device: torch.device) -> None:
        blocks_per_seq = -(-context // BLOCK_SIZE)
        shape = (batch * blocks_per_seq + 1, BLOCK_SIZE, config.num_kv_heads, config.head_size)
        gen = torch.Generator(device=device).manual_seed(0)
        self.kv_caches = [
            (
                0.1 * torch.randn(shape, generator=gen, device=device, dtype=dtype),
                0.1 * torch.randn(shape, generator=gen, device=device, dtype=dtype),
            )
            for _ in range(config.num_layers)
        ]
        tables = 1 + torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, -1)
        pos = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
        slots = tables[:, (context - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
        ids = torch.randint(0, config.vocab_size, (batch,), generator=gen, device=device)
        self.args = (ids, pos, slots, tables, torch.full((batch,), context, dtype=torch.int32, device=device))
        self.blocks_per_seq = blocks_per_seq


class _HfDecode:
    """``transformers``' side: a cache holding ``context - 1`` tokens per sequence, reset to that before each step."""

    def __init__(self, model: Any, static: bool, batch: int, context: int, dtype, device) -> None:
        import transformers

        config = model.config
        kv_heads, head = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
        self.cache = (
            transformers.StaticCache(config=config, max_cache_len=context) if static else transformers.DynamicCache()
        )
        gen = torch.Generator(device=device).manual_seed(0)
        before = context - 1
        for layer in range(config.num_hidden_layers):
            k = 0.1 * torch.randn(batch, kv_heads, before, head, generator=gen, device=device, dtype=dtype)
            v = 0.1 * torch.randn(batch, kv_heads, before, head, generator=gen, device=device, dtype=dtype)
            self.cache.update(k, v, layer, {"cache_position": torch.arange(before, device=device)})
        self.ids = torch.randint(0, config.vocab_size, (batch, 1), generator=gen, device=device)
        self.position = torch.full((batch, 1), before, dtype=torch.long, device=device)
        self.cache_position = torch.tensor([before], device=device)
        self.before = before
        # transformers 5 renamed past_key_values to cache and dropped cache_position along the way
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.pass_position = "cache_position" in inspect.signature(type(model.model).forward).parameters
        self.model = model
        self.static = static

    def rewind(self) -> None:
        """Put the cache back to ``context - 1`` tokens, so every timed step is the same step."""
        if self.static:
            for layer in self.cache.layers:
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.fill_(self.before)
        else:
            extra = self.cache.get_seq_length() - self.before
            if extra > 0:  # a negative count removes that many tokens, in every transformers release
                self.cache.crop(-extra)

    def step(self) -> torch.Tensor:
        self.rewind()
        kwargs: dict[str, Any] = {self.cache_arg: self.cache}
        if self.pass_position:
            kwargs["cache_position"] = self.cache_position
        return self.model(input_ids=self.ids, position_ids=self.position, use_cache=True, **kwargs).logits


def _time(fn: Callable[[], Any], device: torch.device, fast: bool) -> float:
    return median_ms(fn, device, warmup=2 if fast else 3, repeat=5 if fast else 20, min_time_s=0.02 if fast else 0.2)


def run(
    device_name: str | None = None,
    shape: str = "auto",
    layers: int | None = None,
    batches: Sequence[int] = (1, 64),
    context: int = 1024,
    modes: Sequence[str] = MODES,
    dtype: torch.dtype = torch.bfloat16,
    fast: bool = False,
    log: Callable[[str], None] = print,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """Build the model once and time every mode at every batch size; return the results (see :func:`main`).

    :param on_row: called with the results so far after every row (``main`` writes the JSON there, so a
        run cut short by a time limit keeps what it measured).
    """
    from ..flat.flat_model import FlatModel
    from ..runtime import load

    runtime = load(device=device_name)
    device = runtime.device
    if shape == "auto":
        shape = "small" if device.type == "cpu" else "llama3-8b"
    start = time.perf_counter()
    hf_config, hf_model = _hf_model(SHAPES[shape], layers, context, dtype, device)
    model = _flat_model(hf_config, hf_model, dtype)
    log(f"built {shape} ({model.config.num_layers} layers, {dtype}) on {device} in {time.perf_counter() - start:.1f}s")
    copy_gbs = copy_bandwidth_gbs(device, (1 << 30) if device.type != "cpu" else (32 << 20 if fast else 256 << 20))
    weight_bytes = _weight_bytes(model)
    cfg = model.config
    kv_bytes_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_size * torch.finfo(dtype).bits // 8
    capture = runtime.graph_capture()
    runners = {
        "eager": FlatModel(model, runtime, dtype, compile=False),
        "compiled": FlatModel(model, runtime, dtype, compile=True),
    }
    rows: list[dict[str, Any]] = []
    result = {
        "shape": shape,
        "layers": cfg.num_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "context": context,
        "platform": runtime.platform.name,
        "device": _device_name(runtime),
        "copy_gbs": copy_gbs,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "fusions": runners["eager"].graph("decode").fusions,
        "versions": _versions(),
        "threads": torch.get_num_threads(),
        "host_load_before": load_average(),
        "rows": rows,
    }
    for batch in batches:
        ours = _Decode(cfg, batch, context, dtype, device)
        step_bytes = weight_bytes + batch * context * kv_bytes_per_token
        ready: dict[str, tuple[Callable[[], Any], float]] = {}
        for mode in modes:  # set every mode up first (compile, capture, warm), then time them in rounds
            began = time.perf_counter()
            try:
                fn = _mode_fn(mode, runners, ours, hf_model, capture, batch, context, dtype, device)
                with torch.no_grad():
                    fn()
                    synchronize(device)
                ready[mode] = (fn, time.perf_counter() - began)
            except Exception as exc:  # one mode failing (a transformers release it does not know) spoils no other
                why = str(exc) if isinstance(exc, _ModeUnavailableError) else f"failed: {type(exc).__name__}: {exc}"
                rows.append({"mode": mode, "batch": batch, "skipped": why})
                log(f"  {mode:18s} batch {batch:3d}: {why}")
        samples: dict[str, list[float]] = {mode: [] for mode in ready}
        batch_rows: dict[str, dict[str, Any]] = {}
        for _ in range(1 if fast else rounds):
            # round-robin: load from other processes on a shared host lands on every mode alike
            for mode, (fn, setup_s) in ready.items():
                with torch.no_grad():
                    samples[mode].append(_time(fn, device, fast))
                ms = statistics.median(samples[mode])
                batch_rows[mode] = {
                    "mode": mode,
                    "batch": batch,
                    "ms": ms,
                    "best_ms": min(samples[mode]),  # the round least disturbed by other processes
                    "tokens_per_s": batch / ms * 1e3,
                    "bandwidth_utilisation": step_bytes / (ms * 1e-3) / (copy_gbs * 1e9),
                    "setup_s": setup_s,
                    "rounds_ms": list(samples[mode]),
                }
            reports = runners["compiled"].backend.reports
            result["compiler"] = reports[0].compiler if reports else None
            result["host_load_after"] = load_average()
            result["rows"] = rows + list(batch_rows.values())
            if on_row:
                on_row(result)
        rows += batch_rows.values()
        result["rows"] = rows
        for row in batch_rows.values():
            log(
                f"  {row['mode']:18s} batch {batch:3d}: {row['ms']:9.3f} ms/step  {row['tokens_per_s']:10.1f} tok/s  "
                f"{100 * row['bandwidth_utilisation']:5.1f}% of copy bandwidth  (setup {row['setup_s']:.1f}s)"
            )
        del ours, ready
        _free(device)
    return result


class _ModeUnavailableError(Exception):
    """A mode that cannot run here (no graph capture on CPU)."""


def _mode_fn(mode, runners, ours, hf_model, capture, batch, context, dtype, device) -> Callable[[], Any]:
    if mode in ("eager", "compiled"):
        step = runners[mode].decode_step(ours.kv_caches)
        return lambda: step(*ours.args)
    if mode in ("captured", "compiled+captured"):
        if capture is None:
            raise _ModeUnavailableError("the platform has no graph capture")
        runner = runners["compiled" if mode.startswith("compiled") else "eager"]
        graphs = runner.capture_decode(ours.kv_caches, [batch], ours.blocks_per_seq, capture)
        return lambda: graphs(*ours.args)
    if mode in ("hf-eager", "hf-compiled"):
        hf = _HfDecode(hf_model, mode == "hf-compiled", batch, context, dtype, device)
        if mode == "hf-eager":
            return hf.step
        compiled = torch.compile(hf.step, mode="reduce-overhead" if device.type != "cpu" else None, fullgraph=False)
        return compiled
    raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


def _free(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.empty_cache()


def _device_name(runtime: Any) -> str:
    """The device's name as the platform's probe reported it (the host's processor on CPU)."""
    probe = runtime.selected.probe
    if runtime.device.type != "cpu" and probe is not None and probe.devices:
        return probe.devices[0].name
    return host_platform.processor() or host_platform.machine()


def _versions() -> dict[str, str]:
    versions = {"torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import transformers

        versions["transformers"] = transformers.__version__
    return versions


def render(result: dict[str, Any]) -> str:
    """The results as a markdown table, modes as rows, one column group per batch size."""
    batches = sorted({r["batch"] for r in result["rows"]})
    lines = [
        f"{result['shape']} shape, {result['layers']} layers, {result['dtype']}, context {result['context']}, "
        f"on {result['device']} ({result['platform']} platform); copy bandwidth {result['copy_gbs']:.1f} GB/s; "
        f"weights read per step {result['weight_bytes'] / 1e9:.3f} GB; {result.get('threads')} threads, host load "
        f"{result.get('host_load_before')} before, {result.get('host_load_after')} after",
        "",
        "| mode | " + " | ".join(f"batch {b}: ms/step | tok/s | of copy bw" for b in batches) + " |",
        "| --- | " + " | ".join("---: | ---: | ---:" for _ in batches) + " |",
    ]
    modes = [m for m in MODES if any(r["mode"] == m for r in result["rows"])]
    for mode in modes:
        cells = []
        for b in batches:
            row = next((r for r in result["rows"] if r["mode"] == mode and r["batch"] == b), None)
            if row is None or "skipped" in row:
                cells.append("- | - | -")
            else:
                cells.append(f"{row['ms']:.3f} | {row['tokens_per_s']:.1f} | {100 * row['bandwidth_utilisation']:.1f}%")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    skipped = {r["mode"]: r["skipped"] for r in result["rows"] if "skipped" in r}
    lines += ["", *(f"- {mode}: skipped ({why})" for mode, why in skipped.items())] if skipped else []
    return "\n".join(lines)


def main(
    device: str | None = None,
    shape: str = "auto",
    layers: int | None = None,
    batches: Sequence[int] = (1, 64),
    context: int = 1024,
    modes: Sequence[str] = MODES,
    dtype: str = "bfloat16",
    json_path: str | None = None,
    fast: bool = False,
    rounds: int = ROUNDS,
    threads: int | None = None,
) -> int:
    """Run and print the table; write ``json_path`` when given. Returns the exit status."""
    unknown = set(modes) - set(MODES)
    if unknown:
        print(f"error: unknown modes {sorted(unknown)}; modes: {', '.join(MODES)}")
        return 2

    def write(result: dict[str, Any]) -> None:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=2)

    if threads:
        torch.set_num_threads(threads)
    result = run(
        device, shape, layers, batches, context, modes, getattr(torch, dtype), fast, on_row=write, rounds=rounds
    )
    write(result)
    print()
    print(render(result))
    return 0
