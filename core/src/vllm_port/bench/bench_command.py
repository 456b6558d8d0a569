"""``vllm-port bench KIND``: the benchmarks, one subcommand each, declared here and run by their own modules.

Each kind is a row of :data:`KINDS`: its one-line help, its options and its run function, which
imports the benchmark's module (and torch) only when that benchmark runs. Exit status: the
benchmark's, or 2 when it cannot run here (an unknown or unavailable platform, said in one line).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from ..cli_flags import add_device_flag, add_json_file_flag

__all__ = ["ENGINE_SHAPES", "HELP", "KINDS", "PLACEMENT_SHAPES", "add_arguments", "run"]

HELP = "benchmarks (not tests): see docs/results/"

#: The random models ``bench placement --shape`` builds: the keys of :data:`vllm_port.bench.placement.SHAPES`
#: (a test holds them equal), named here so that declaring the options imports no torch.
PLACEMENT_SHAPES = ("llama3-8b", "small", "tiny")
#: The layers ``bench moe --shape`` builds: the keys of :data:`vllm_port.bench.moe.SHAPES`.
MOE_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "tiny")
#: The presets of ``bench engine --shape``: the keys of :data:`vllm_port.bench.engine_workload.SHAPES`.
ENGINE_SHAPES = ("llama3-8b", "qwen3-30b-a3b")
#: The dtypes a benchmark's random model or inputs may take.
DTYPES = ["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class BenchKind:
    """One ``vllm-port bench`` subcommand."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommands of ``vllm-port bench``, each with its options."""
    kinds = parser.add_subparsers(dest="kind", required=True)
    for name, kind in KINDS.items():
        kind.add_arguments(kinds.add_parser(name, help=kind.help))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.kind`` with parsed ``args``; return the exit status (2 when it cannot run here)."""
    from ..errors import VllmPortError

    try:
        return KINDS[args.kind].run(args)
    except VllmPortError as exc:  # an unknown or unavailable platform, a model that cannot load: said, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _dispatch_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_file_flag(parser)


def _run_dispatch(args: argparse.Namespace) -> int:
    from . import dispatch

    return dispatch.main(json_path=args.json)


def _ops_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flag(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    parser.add_argument("--max-tokens", type=int, default=32768, help="skip token counts above this")
    parser.add_argument(
        "--full",
        action="store_true",
        help="on a CPU, time every size (up to 32k tokens: many minutes, ~15 GB); by default CPU runs stop at "
        "sizes that finish in minutes within a few GB",
    )
    add_json_file_flag(parser, "write the results to this JSON file")
    parser.add_argument("--plot", default=None, help="draw fraction-of-ceiling vs tokens to this PNG file")


def _run_ops(args: argparse.Namespace) -> int:
    from . import ops

    return ops.main(args.device, args.dtype, args.ops, args.max_tokens, args.json, args.plot, full=args.full)


def _pool_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_file_flag(parser)


def _run_pool(args: argparse.Namespace) -> int:
    from . import pool

    return pool.main(json_path=args.json)


def _swap_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_file_flag(parser)
    add_device_flag(parser)


def _run_swap(args: argparse.Namespace) -> int:
    from . import swap

    return swap.main(json_path=args.json, device_name=args.device)


def _comm_arguments(parser: argparse.ArgumentParser) -> None:
    add_json_file_flag(parser)
    add_device_flag(parser)
    parser.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message in bytes (default 64 MB)")


def _run_comm(args: argparse.Namespace) -> int:
    from . import comm

    return comm.main(json_path=args.json, device=args.device, max_bytes=args.max_bytes)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flag(parser)
    parser.add_argument(
        "--shape", default="auto", choices=["auto", "llama3-8b", "small"], help="auto: llama3-8b on a GPU, small on CPU"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the shape (default: all)")
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes (default 1,64)")
    parser.add_argument("--context", type=int, default=1024, help="tokens in each sequence's cache (default 1024)")
    parser.add_argument("--modes", default=None, help="comma-separated modes (default: all)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--fast", action="store_true", help="fewer timing repeats (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds over all modes (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_json_file_flag(parser, "write the results to this JSON file")


def _run_model(args: argparse.Namespace) -> int:
    from . import decode_modes

    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",") if args.modes else decode_modes.MODES
    return decode_modes.main(
        args.device,
        args.shape,
        args.layers,
        batches,
        args.context,
        modes,
        args.dtype,
        args.json,
        args.fast,
        args.rounds,
        args.threads,
    )


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a saved model directory (default: build a random one)")
    parser.add_argument("--h200", action="store_true", help="issue 13's H200 workload (= --shape llama3-8b)")
    parser.add_argument(
        "--shape",
        default=None,
        choices=ENGINE_SHAPES,
        help="a GPU preset: llama3-8b (bf16, 256 requests of 512/256 tokens, decode at 1 and 64), or "
        "qwen3-30b-a3b (the same workload on Qwen3-30B-A3B's shape, a MoE, 8 of its 48 layers by default); "
        "default: the CPU workload",
    )
    parser.add_argument(
        "--weights",
        default=None,
        help="comma-separated checkpoints to run the engine on, each built from the same random weights: bf16, "
        "fp16 or fp32 (float, in that dtype) and fp8 (the decoder projections in float8 with per-channel "
        "scales); e.g. bf16,fp8 prints the fp8 / bf16 decode ratio (default: float in --dtype)",
    )
    add_device_flag(parser, "platform for the engine (default: the selected one)")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--intermediate-size", type=int, default=None, help="a dense MLP's width")
    parser.add_argument(
        "--layers",
        "--num-layers",
        dest="num_layers",
        type=int,
        default=None,
        help="decoder layers (of a preset: fewer)",
    )
    parser.add_argument("--heads", dest="num_heads", type=int, default=None)
    parser.add_argument("--kv-heads", dest="num_kv_heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None, help="each head's width (default: hidden / heads)")
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--num-experts", type=int, default=None, help="routed experts per layer (a MoE shape)")
    parser.add_argument(
        "--experts-per-tok", dest="num_experts_per_tok", type=int, default=None, help="experts per token (a MoE shape)"
    )
    parser.add_argument("--moe-intermediate-size", type=int, default=None, help="each expert's width (a MoE shape)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests (CPU 64, H200 256)")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (CPU 128, H200 512)")
    parser.add_argument("--output-len", type=int, default=None, help="output tokens (CPU 128, H200 256)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--decode-batches", default=None, help="comma-separated decode batch sizes (H200: 1,64)")
    parser.add_argument(
        "--systems",
        default="engine,transformers,vllm",
        help="which to run (comma-separated): engine, transformers, transformers-compiled (static cache, decode "
        "step under torch.compile reduce-overhead), vllm",
    )
    parser.add_argument("--step", default="eager", choices=["eager", "flat"], help="the engine's step function")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="the engine replays no captured graphs (default: it does where it can)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine schedules each step before reading the last one's tokens (LLM(async_scheduling=True); "
        "default: the engine's, on for one accelerator, off on cpu)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="the engine's KV cache (LLM(kv_cache_dtype=...)): auto, the model's dtype, or fp8 e4m3 with per-tensor "
        "scales; the decode rows count its bytes (transformers and vLLM keep their own caches)",
    )
    parser.add_argument(
        "--save-model",
        default=None,
        help="build the random model into this directory, or reuse the one there (fp8 weights: DIR-fp8)",
    )
    parser.add_argument(
        "--mixed-requests",
        type=int,
        default=0,
        help="also run a mixed workload of this many requests (lognormal lengths around the workload's) and "
        "report inter-token latency with prefill steps replayed and eager (H200: 1000; default: none)",
    )
    parser.add_argument("--vllm-python", default=None, help="the python of a vLLM venv (dev/setup-vllm-peer)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads for this process")
    parser.add_argument("--seed", type=int, default=0)
    add_json_file_flag(parser, "write the results to this JSON file")


def _run_engine(args: argparse.Namespace) -> int:
    from . import engine

    return engine.main(args)


def _placement_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a model directory (default: build a random one of --shape)")
    parser.add_argument("--save-model", default=None, help="build the random model here, or reuse the one there")
    parser.add_argument(
        "--shape", default="tiny", choices=PLACEMENT_SHAPES, help="the random model's shape (default tiny)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer layers of the shape")
    add_device_flag(parser, "the device platform (default: the best available)", default="auto")
    parser.add_argument("--host", default="cpu", help="the platform the placed parts run on (default cpu)")
    parser.add_argument("--place", default="mlp", help="parts on the host: mlp, lm_head or mlp,lm_head (default mlp)")
    parser.add_argument("--device-budget", type=float, default=None, metavar="GIB", help="the device's memory budget")
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per batch size after the first, the median reported (default 3)"
    )
    add_json_file_flag(parser)


def _run_placement(args: argparse.Namespace) -> int:
    from . import placement

    return placement.main(args)


#: ``vllm-port bench NAME`` -> the benchmark, in the order ``vllm-port bench --help`` lists them.
def _serve_load_arguments(parser: argparse.ArgumentParser) -> None:
    from .serve_load import add_arguments as serve_load_arguments  # the standard library alone

    serve_load_arguments(parser)


def _run_serve_load(args: argparse.Namespace) -> int:
    from . import serve_load

    return serve_load.run(args)


def _moe_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flag(parser)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=MOE_SHAPES, help="the layer's model")
    parser.add_argument("--tokens", default="1,8,64,4096,8192", help="comma-separated token counts")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--sweep", action="store_true", help="also time the Triton kernels with other tiles")
    add_json_file_flag(parser, "write the results to this JSON file")


def _run_moe(args: argparse.Namespace) -> int:
    from . import moe

    tokens = [int(t) for t in args.tokens.split(",")]
    return moe.main(args.device, args.shape, tokens, args.dtype, args.json, sweep=args.sweep)


def _fp8_linear_arguments(parser: argparse.ArgumentParser) -> None:
    add_device_flag(parser)
    parser.add_argument("--rows", default="1,16,256,4096", help="comma-separated token counts (default 1,16,256,4096)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    add_json_file_flag(parser, "write the results to this JSON file")


def _run_fp8_linear(args: argparse.Namespace) -> int:
    from . import fp8_linear

    shapes = tuple(args.shapes.split(",")) if args.shapes else tuple(fp8_linear.SHAPES)
    unknown = [s for s in shapes if s not in fp8_linear.SHAPES]
    if unknown:
        print(f"error: unknown shapes {unknown}; known: {', '.join(fp8_linear.SHAPES)}", file=sys.stderr)
        return 2
    return fp8_linear.main(args.json, tuple(int(m) for m in args.rows.split(",")), shapes, args.device)


KINDS: dict[str, BenchKind] = {
    "dispatch": BenchKind("overhead of calling a bound op on CPU", _dispatch_arguments, _run_dispatch),
    "ops": BenchKind(
        "every provider of every op against eager, Inductor and the device's ceilings", _ops_arguments, _run_ops
    ),
    "pool": BenchKind("KV block pool ops per second and usable KV capacity", _pool_arguments, _run_pool),
    "moe": BenchKind(
        "one MoE layer (Qwen3-30B-A3B's by default): the bound fused_moe beside torch._grouped_mm, L2 flushed",
        _moe_arguments,
        _run_moe,
    ),
    "swap": BenchKind(
        "migrator swap bandwidth device <-> pinned host vs a plain pinned copy_ (needs a GPU)",
        _swap_arguments,
        _run_swap,
    ),
    "comm": BenchKind(
        "all_reduce bus bandwidth through the comm contract against torch.distributed, 2 ranks",
        _comm_arguments,
        _run_comm,
    ),
    "model": BenchKind(
        "decode-step time of a Llama-shaped model: eager, compiled, graph-captured, beside transformers",
        _model_arguments,
        _run_model,
    ),
    "engine": BenchKind(
        "offline throughput of LLM.generate beside transformers and vLLM on one workload",
        _engine_arguments,
        _run_engine,
    ),
    "serve-load": BenchKind(
        "streaming clients against vllm-port serve, some leaving mid-stream: well formed, equal, no leak",
        _serve_load_arguments,
        _run_serve_load,
    ),
    "fp8-linear": BenchKind(
        "the Triton fp8_linear beside torch._scaled_mm (cuBLASLt) and bf16 matmul at Llama-3-8B shapes (needs a GPU)",
        _fp8_linear_arguments,
        _run_fp8_linear,
    ),
    "placement": BenchKind(
        "decode tok/s with the MLPs or LM head on the host under a device budget, vs all on the host",
        _placement_arguments,
        _run_placement,
    ),
}
