"""What debug mode costs a bound op: ``python core/tests/faults/bench_faults.py [--json F]`` (a benchmark, not a test).

Times, in one run, the CPU plugin's ``rms_norm`` and an empty kernel called four ways: the provider
directly, the bound op with debug mode off (``kernels.rms_norm``, the provider's own function), the
bound op in debug mode on a call it does not compare (the metadata check only), and on a call it
compares with the float64 reference. Best of 7 repeats, per call, as ``vllm-port bench dispatch``.
The engine's overhead at the default rate is measured with ``vllm-port bench engine`` (docs/results/faults.md).
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import replace
from typing import Any

import torch

import vllm_port
from vllm_port.bench.dispatch import _per_call_ns
from vllm_port.ops import BoundOps
from vllm_port.ops.debug import CheckConfig, CheckedOp


def _checked(kernels: BoundOps, rate: float) -> CheckedOp:
    op = next(o for o in vllm_port.load(device="cpu").registry.ops.values() if o.name == "rms_norm")
    checked = CheckedOp(op, kernels, [kernels.providers["rms_norm"]], CheckConfig(rate=rate))
    return checked


def measure() -> dict[str, Any]:
    runtime = vllm_port.load(device="cpu")
    kernels = runtime.bind(torch.float32, check=False)
    chosen = kernels.providers["rms_norm"]
    empty = BoundOps(kernels.context, {"rms_norm": replace(chosen, fn=lambda x, weight, epsilon: x)})
    x, w = torch.randn(1, 64), torch.ones(64)
    results: dict[str, dict[str, float]] = {}
    for label, bound, number in (("empty kernel", empty, 200_000), ("rms_norm [1, 64] float32", kernels, 20_000)):
        fn = bound.providers["rms_norm"].fn
        unsampled = _checked(bound, rate=1e-12)
        unsampled._calls = 1  # past the first call, which is always compared: none of the timed ones is
        every = _checked(bound, rate=1.0)
        rows = {
            "provider called directly": _per_call_ns(lambda fn=fn: fn(x, w, 1e-6), number),
            "bound op, debug mode off": _per_call_ns(lambda b=bound: b.rms_norm(x, w, 1e-6), number),
            "bound op, debug mode, call not compared": _per_call_ns(lambda c=unsampled: c(x, w, 1e-6), number),
        }
        if label != "empty kernel":  # an empty kernel disagrees with the reference: it would be quarantined
            rows["bound op, debug mode, call compared"] = _per_call_ns(lambda c=every: c(x, w, 1e-6), number // 10)
        results[label] = rows
    return {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "provider": chosen.name,
        "ns_per_call": results,
    }


def measure_engine(rounds: int, rate: str = "on") -> dict[str, Any]:
    """``vllm-port bench engine``'s CPU workload at 2 layers and 16 requests, debug mode off and on in turn, in one process.

    Each round builds an ``LLM`` per mode, warms it up (each provider's first call, always compared,
    falls there) and times one ``generate`` of every request: wall time and this process's CPU time,
    which a busy shared machine disturbs less than the wall clock.
    """
    import os
    import statistics
    import tempfile
    import time

    import vllm_port.ops._checked as debug  # where CheckedOp looks the comparison up
    from vllm_port import LLM, SamplingParams
    from vllm_port.bench import engine as bench_engine

    compare_s = [0.0]
    compare = debug.compare_with_reference

    def timed_compare(*args: Any) -> Any:  # the debug work of a compared call, timed inside the run itself
        start = time.perf_counter()
        try:
            return compare(*args)
        finally:
            compare_s[0] += time.perf_counter() - start

    debug.compare_with_reference = timed_compare
    w = replace(bench_engine.CPU_WORKLOAD, num_layers=2, num_requests=16)
    model_dir = bench_engine.build_model(tempfile.mkdtemp(prefix="vllm-port-faults-"), w)
    prompts = bench_engine.make_prompts(w)
    params = SamplingParams(temperature=0.0, max_tokens=w.output_len, ignore_eos=True)
    times: dict[str, list[tuple[float, float]]] = {"off": [], rate: []}
    inside: list[dict[str, float]] = []  # per debug run: calls, compared calls, seconds comparing, wall
    for round_ in range(rounds + 1):  # round 0 warms the process up (allocator, thread pools) and is dropped
        for mode in times:
            os.environ.pop("VLLM_PORT_CHECK", None)
            if mode != "off":
                os.environ["VLLM_PORT_CHECK"] = mode
            llm = LLM(str(model_dir), device="cpu", dtype=w.dtype, max_model_len=w.prompt_len + w.output_len,
                      max_num_seqs=w.num_requests, enable_prefix_caching=False, seed=0)  # fmt: skip
            llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            checked = [getattr(llm.runner.ops, op) for op in llm.runner.ops.providers]
            calls = [getattr(c, "_calls", 0) for c in checked]
            compared = [getattr(c, "compared", 0) for c in checked]
            compare_s[0] = 0.0
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params)
            elapsed = time.perf_counter() - wall
            if round_:
                times[mode].append((elapsed, time.process_time() - cpu))
                if mode != "off":
                    inside.append({
                        "calls": sum(c._calls for c in checked) - sum(calls),
                        "compared": sum(c.compared for c in checked) - sum(compared),
                        "compare_s": round(compare_s[0], 4),
                        "wall_s": round(elapsed, 3),
                    })  # fmt: skip
            llm.close()
    debug.compare_with_reference = compare
    os.environ.pop("VLLM_PORT_CHECK", None)
    tokens = w.num_requests * w.output_len
    summary = {
        mode: {
            "wall_s": [round(t[0], 3) for t in runs],
            "cpu_s": [round(t[1], 3) for t in runs],
            "median_output_tok_s": round(tokens / statistics.median(t[0] for t in runs), 1),
        }
        for mode, runs in times.items()
    }
    for key in ("wall_s", "cpu_s"):
        off, on = (statistics.median(summary[m][key]) for m in ("off", rate))
        summary[f"overhead_{key.removesuffix('_s')}_median"] = round(on / off - 1, 4)
        off, on = (min(summary[m][key]) for m in ("off", rate))
        summary[f"overhead_{key.removesuffix('_s')}_min"] = round(on / off - 1, 4)
    summary["debug_runs"] = inside
    return {"workload": f"{w.num_requests} requests x {w.prompt_len} prompt / {w.output_len} output tokens, "
            f"{w.num_layers} layers, hidden {w.hidden_size}, vocab {w.vocab_size}, {w.dtype}, greedy",
            "rounds": rounds, "rate": rate, **summary}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--engine-rounds", type=int, default=0, help="also time the engine, off and on in turn")
    parser.add_argument("--rate", default="on", help="VLLM_PORT_CHECK for the engine runs (default: on, 0.01)")
    args = parser.parse_args()
    result = measure()
    if args.engine_rounds:
        result["engine"] = measure_engine(args.engine_rounds, args.rate)
        print(json.dumps(result["engine"], indent=2))
    print(f"bound-op cost with and without debug mode on {result['machine']}, torch {result['torch']}")
    for title, rows in result["ns_per_call"].items():
        base = rows["provider called directly"]
        print(f"\n{title}\n{'call':<42}{'ns/call':>10}{'added ns':>10}")
        for name, ns in rows.items():
            print(f"{name:<42}{ns:>10.0f}{ns - base:>10.0f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
