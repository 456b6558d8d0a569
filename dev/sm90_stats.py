"""Compile the prefill attention kernel for sm_90 on a machine without a GPU, and say what the compiler made of it.

    python3 dev/sm90_stats.py                       # the CUDA target's tiles and the tiles the H200 runs compared
    python3 dev/sm90_stats.py --tiles 128,64,4,2    # one configuration: block_m, block_n, warps, stages
    python3 dev/sm90_stats.py --json                # the Triton, Hopper (Gluon) and experimental kernels as JSON (CI)

Run it without ``TRITON_INTERPRET``: the interpreter replaces the kernels with Python the compiler cannot take.

Triton compiles for any NVIDIA target offline (its wheel bundles ``ptxas``), so registers, spills, shared
memory and the order of the tensor-core instructions can be read before a GPU is lent. Per configuration
(bf16, head 128, 128-token cache blocks through TMA, 4 query heads per KV head):

- ``regs`` and ``stack`` (bytes of local memory a thread), ``spill st/ld``: ``STL``/``LDL`` instructions in
  the SASS; ``shared``: bytes of shared memory a program takes, and how many programs fit one SM (228 KiB);
- ``wgmma``/``TMA loads``: ``wgmma.mma_async`` and ``cp.async.bulk.tensor`` instructions in the PTX;
- ``waits``: the ``wgmma.wait_group N`` operands. ``0`` everywhere means every matrix product is waited
  for before anything else runs: no softmax of one tile under the tensor cores of the next within a warp.

The Gluon kernels are listed too: the CUDA plugin's Hopper prefill (``vllm_port_cuda.hopper_prefill``,
warp-specialised: ``setmaxnreg`` hands registers from the producer warp to the consumers, and no CTA-wide
``bar.sync`` remains) and the first experiment (``dev/experiments/gluon_prefill.py``); in both the waits read ``1`` where
the softmax runs under the ``P V`` product.

What it showed (docs/results/attention-h200.md): the shipped 128 x 64 x 4-warp tiles spill (255 registers
and 1.7 KiB of stack) yet ran fastest, because two programs share an SM; every configuration waits with
``0`` before the softmax, and so did an experiment (not kept) that carried the next tile's scores across
loop iterations to overlap them with this tile's exponentials.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_port.kernels.triton.attention import _prefill_kernel
from vllm_port.kernels.triton_target import PREFILL_ORDERS, TritonTarget
from vllm_port_cuda.triton_targets import CUDA

SM_SHARED_BYTES = 228 * 1024  # an H100/H200 multiprocessor's shared memory (227 KiB a block, 1 KiB reserved a block)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

#: The tiles the H200 runs measured (dev/experiments/probe_hopper.py), beside the target's own.
COMPARED = ((128, 128, 8, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 128, 4, 2))


@dataclass(frozen=True)
class KernelStats:
    """What ``ptxas`` and Triton made of one configuration of the prefill kernel for sm_90."""

    tiles: tuple[int, int, int, int]  # block_m, block_n, warps, stages
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    wgmma: int
    tma_loads: int
    waits: tuple[int, ...]
    cta_barriers: int = 0  # ``bar.sync 0;``: every warp of the program waits for every other
    register_handoffs: int = 0  # ``setmaxnreg``: warp-specialised partitions trading registers

    @property
    def programs_per_sm(self) -> int:
        """Programs one SM holds, by shared memory and by registers (65,536 a multiprocessor)."""
        threads = 32 * self.tiles[2]
        by_shared = SM_SHARED_BYTES // (self.shared_bytes + 1024)
        by_registers = 65536 // (max(self.registers, 1) * threads)
        return min(by_shared, by_registers)


def compile_prefill(target: TritonTarget = CUDA, head: int = 128, group: int = 4, block_size: int = 128) -> KernelStats:
    """Compile ``_prefill_kernel`` with ``target``'s tiles for sm_90 (bf16, TMA, causal, no window or cap)."""
    block_m, block_n, warps, stages = target.attn_block_m, target.attn_block_n, target.attn_warps, target.attn_stages
    desc = f"tensordesc<bf16[1,{block_n},{head}]>"
    pointers = ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")
    strides = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
               "stride_vs", "stride_vh", "stride_bt")  # fmt: skip
    signature = {
        **dict.fromkeys(pointers, "*bf16"),
        **dict.fromkeys(("block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"), "*i32"),
        "scale": "fp32",
        "soft_cap": "fp32",
        "sliding_window": "i32",
        "out_scale": "fp32",
        **dict.fromkeys(strides, "i32"),
        "k_desc": desc,
        "v_desc": desc,
    }
    constants = {"GROUP": group, "HEAD_SIZE": head, "HEAD_PAD": head, "BLOCK_SIZE": block_size, "BLOCK_M": block_m,
                 "BLOCK_N": block_n, "PAGE_TILE": True, "USE_SOFT_CAP": False, "USE_WINDOW": False,
                 "DOT_PRECISION": None, "DOT_FP32": False, "TMA": True,
                 "ORDER": PREFILL_ORDERS.index(target.prefill_order)}  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    kernel = triton.compile(
        ASTSource(
            fn=_prefill_kernel.kernel, signature=signature, constexprs=constants
        ),  # the jit function under its cached launch
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    return _stats(kernel, (block_m, block_n, warps, stages))


def compile_gluon_prefill(group: int = 4, block_size: int = 128) -> KernelStats:
    """Compile ``dev/experiments/gluon_prefill.py``'s experimental kernel (FlashAttention-3's intra-warpgroup overlap) for sm_90."""
    experiments = os.path.join(os.path.dirname(os.path.abspath(__file__)), "experiments")
    if experiments not in sys.path:  # dev/experiments/gluon_prefill.py
        sys.path.insert(0, experiments)
    import gluon_prefill as g
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    q_layout = gl.NVMMASharedLayout.get_default_for([g.BLOCK_M, g.HEAD], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([g.BLOCK_N, g.HEAD], gl.bfloat16)
    signature = {
        "q_desc": f"tensordesc<bf16[{g.BLOCK_M},{g.HEAD}],{q_layout!r}>",
        "k_desc": f"tensordesc<bf16[{g.BLOCK_N},{g.HEAD}],{kv_layout!r}>",
        "v_desc": f"tensordesc<bf16[{g.BLOCK_N},{g.HEAD}],{kv_layout!r}>",
        "out_ptr": "*bf16",
        **dict.fromkeys(("block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"), "*i32"),
        "qk_scale": "fp32",
        **dict.fromkeys(("stride_ot", "stride_oh", "stride_bt"), "i32"),
    }
    constants = {"GROUP": group, "BLOCK_SIZE": block_size, "BLOCK_M": g.BLOCK_M, "BLOCK_N": g.BLOCK_N, "HEAD": g.HEAD}
    signature.update(dict.fromkeys(constants, "constexpr"))
    kernel = triton.compile(
        GluonASTSource(g._gluon_prefill_kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": g.NUM_WARPS},
    )
    return _stats(kernel, (g.BLOCK_M, g.BLOCK_N, g.NUM_WARPS, 2))


def compile_hopper_prefill(group: int = 4, block_size: int = 128) -> KernelStats:
    """Compile the CUDA plugin's Hopper prefill (``vllm_port_cuda.hopper_prefill``, Gluon, warp-specialised) for
    sm_90: bf16, 3-D K/V descriptors (one box a key tile, or one a block for blocks under 128 tokens), ping-pong on."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from vllm_port_cuda import hopper_prefill as h

    q_layout = gl.NVMMASharedLayout.get_default_for([h.ROWS, h.HEAD], gl.bfloat16)
    box = min(block_size, h.TILE)  # blocks smaller than a tile: a box a block
    kv_layout = gl.NVMMASharedLayout.get_default_for([1, box, h.HEAD], gl.bfloat16)
    kv_desc = f"tensordesc<bf16[1,{box},{h.HEAD}],{kv_layout!r}>"
    signature = {
        "q_desc": f"tensordesc<bf16[{h.ROWS},{h.HEAD}],{q_layout!r}>",
        "k_desc": kv_desc,
        "v_desc": kv_desc,
        "out_ptr": "*bf16",
        **dict.fromkeys(("block_tables_ptr", "cu_seqlens_q_ptr", "seq_lens_ptr"), "*i32"),
        "qk_scale": "fp32",
        **dict.fromkeys(("stride_ot", "stride_oh", "stride_bt"), "i32"),
    }
    constants = {"GROUP": group, "BLOCK_SIZE": block_size, "TILE": h.TILE, "ROWS": h.ROWS, "HEAD": h.HEAD,
                 "CONSUMER_REGS": h.CONSUMER_REGS, "PRODUCER_REGS": h.PRODUCER_REGS, "PINGPONG": True}  # fmt: skip
    signature.update(dict.fromkeys(constants, "constexpr"))
    kernel = triton.compile(
        GluonASTSource(h._hopper_prefill_kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 4},
    )
    return _stats(kernel, (h.TILE, h.TILE, kernel.metadata.num_warps, 2))


def _stats(kernel, tiles: tuple[int, int, int, int]) -> KernelStats:
    usage, sass = _cuobjdump(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    return KernelStats(
        tiles=tiles,
        registers=int(re.search(r"REG:(\d+)", usage).group(1)),
        stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
        spill_stores=len(re.findall(r"\bSTL\b", sass)),
        spill_loads=len(re.findall(r"\bLDL\b", sass)),
        shared_bytes=kernel.metadata.shared,
        wgmma=ptx.count("wgmma.mma_async"),
        tma_loads=ptx.count("cp.async.bulk.tensor"),
        waits=tuple(int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)),
        cta_barriers=len(re.findall(r"\bbar\.sync\s+0;", ptx)),
        register_handoffs=ptx.count("setmaxnreg"),
    )


def _cuobjdump(cubin: bytes) -> tuple[str, str]:
    """The cubin's resource usage and its SASS, by the ``cuobjdump`` in Triton's wheel."""
    tool = os.path.join(_BIN, "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage, sass = (
            subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout  # noqa: S603
            for flag in ("-res-usage", "-sass")
        )
        return usage, sass


def describe(stats: KernelStats) -> str:
    m, n, w, s = stats.tiles
    return (
        f"m{m} n{n} w{w} s{s}: regs {stats.registers}, stack {stats.stack_bytes} B, spill st/ld "
        f"{stats.spill_stores}/{stats.spill_loads}, shared {stats.shared_bytes / 1024:.0f} KiB, "
        f"{stats.programs_per_sm} program(s) an SM, wgmma {stats.wgmma}, TMA loads {stats.tma_loads}, "
        f"waits {sorted(set(stats.waits))}, CTA-wide barriers {stats.cta_barriers}, setmaxnreg {stats.register_handoffs}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default=None, help="block_m,block_n,warps,stages (default: the target's and more)")
    parser.add_argument("--json", action="store_true", help="print the CUDA target's statistics as JSON, nothing else")
    opts = parser.parse_args(argv)
    if opts.json:
        report = {}
        kernels = (
            ("shipped", compile_prefill()),
            ("hopper", compile_hopper_prefill()),
            ("hopper_block16", compile_hopper_prefill(block_size=16)),
            ("gluon", compile_gluon_prefill()),
        )
        for name, stats in kernels:
            report[name] = {**dataclasses.asdict(stats), "programs_per_sm": stats.programs_per_sm}
        print(json.dumps(report))
        return 0
    if opts.tiles:
        configurations = [tuple(int(v) for v in opts.tiles.split(","))]
    else:
        configurations = [(CUDA.attn_block_m, CUDA.attn_block_n, CUDA.attn_warps, CUDA.attn_stages), *COMPARED]
    print(f"prefill_attention for sm_90, bf16, head 128, TMA; triton {triton.__version__}")
    for m, n, w, s in configurations:
        target = dataclasses.replace(CUDA, attn_block_m=m, attn_block_n=n, attn_warps=w, attn_stages=s)
        label = " (the CUDA target)" if target == CUDA else ""
        print(describe(compile_prefill(target)) + label, flush=True)
    if not opts.tiles:
        print(describe(compile_hopper_prefill()) + " (vllm_port_cuda.hopper_prefill, shipped on sm_90)", flush=True)
        print(
            describe(compile_gluon_prefill()) + " (dev/experiments/gluon_prefill.py, the first Gluon experiment)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
