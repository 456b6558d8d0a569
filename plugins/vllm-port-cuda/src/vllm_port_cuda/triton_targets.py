"""The CUDA plugin's launch configurations of the shared Triton kernels, one per family of NVIDIA parts.

Core's shared Triton kernels (:mod:`vllm_port.kernels.triton`) are written once; each launcher derives
block sizes, warps and pipeline stages from the :class:`~vllm_port.kernels.triton_target.TritonTarget`
it is given. The tiles of the attention kernels must fit a multiprocessor's shared memory, which
differs threefold across NVIDIA's parts: :func:`vllm_port_cuda.ops.target_for` picks the target
whose tiles fit every visible GPU. Plain data: importing this module needs no Triton.
"""

from __future__ import annotations

from vllm_port.kernels.triton_target import LinearTiles, MoeTiles, TritonTarget

__all__ = ["CUDA", "CUDA_AMPERE", "CUDA_COMPACT"]

#: NVIDIA Hopper and newer data-centre parts (sm_90, sm_100: 227 KiB of shared memory a block, TMA); picked by compute capability (:func:`vllm_port_cuda.ops.target_for`).
#: Element-wise blocks of 2048 measured best on an H200 (dev/tune_elementwise.py). ``linear`` (dev/tune_linear.py on
#: an H200, docs/results/linear-h200.md: Llama-3-8B's decode products replayed from CUDA graphs over cold weights,
#: as the engine runs them): one row on vector units, 16 weight rows a program, 512 bfloat16 of a row a step,
#: 4 warps, 2 stages, the reduction split only below one program per SM; it serves one row and weights up to
#: 64 MiB (qkv 14.4 us against cuBLAS's 15.4, o 11.0 against 13.4); cuBLAS keeps the larger weights (gate_up 0.97x,
#: down 1.01x, lm_head 1.00x: both stream them at the copy bandwidth) and every product of more rows, where the
#: tensor-core path measured 0.87-0.98x.
#: Attention (dev/tune_attention.py and dev/probe_hopper.py on an H200, docs/results/attention-h200.md): prefill
#: takes 128 x 64 tiles over 4 warps, 2 stages (Q 32 KiB + 2 x 32 KiB of K/V for bf16 x 128: two programs share
#: an SM, one's softmax overlapping the other's MMAs), with TMA where a key tile lies inside one cache block (the
#: platform's 128-token blocks), every head's heaviest query block launched first (8k tokens: 1,095 us against
#: 1,173 for 128 x 128 tiles over 8 warps one head at a time); decode streams 64-key tiles over 4 warps, 2 stages
#: deep, splits each sequence's keys until about 8 programs per SM run, each split at least 8 tiles (1 x 32k:
#: 64 splits). ``fused_moe`` (chosen from first principles until ``vllm-port bench moe`` measures them on an
#: H200): up to 64 tokens, 16 pair rows by 32 columns with 128 bfloat16 of a weight row per step (4 stages in
#: flight; narrow columns give one token's 8 experts of Qwen3-30B-A3B 192 gate/up programs, more than the 132
#: SMs, each streaming its expert's weight rows once); above, 64 x 128 tiles stepping 64 deep over 4 warps,
#: 3 stages (the grouped GEMM of prefill): 80 and 120 KiB of shared memory in bfloat16.
#: ``fp8_linear`` multiplies e4m3 operands on the FP8 tensor cores (``fp8_dot``), with ``TritonTarget``'s default
#: tiles until ``vllm-port bench fp8-linear`` has been run on an H200: at decode 16-row tiles of 64 outputs, 256
#: input features a step (256 bytes of each weight row), 4 stages, the reduction split to 4 programs per SM; at
#: prefill 128 x 128 tiles, 128 deep, 8 warps, 3 stages. The older parts widen e4m3 to bfloat16 (no FP8 MMA on
#: sm_80/sm_86; Ada's sm_89 has it but shares the compact target with sm_86).
#: One row of ``fp8_linear`` (batch-1 decode) takes ``linear``'s one-row kernel with the e4m3 weight widened
#: in registers (``fp8_one_row``): 8 outputs a program, 1,024 input features (1 KiB of each weight row) a step,
#: 3 stages, split to one wave: the fastest of 7 tilings over Llama-3-8B's four projections on an H200
#: (dev/experiments/probe_fp8_one_row.py; docs/results/fp8-linear-h200.md).
CUDA = TritonTarget(
    "cuda",
    elementwise_block=2048,
    attn_block_m=128,
    attn_block_n=64,
    attn_warps=4,
    attn_stages=2,
    decode_block_n=64,
    decode_warps=4,
    decode_stages=2,
    decode_programs_per_sm=8,
    decode_min_tiles_per_split=8,
    decode_tma=True,
    prefill_tma=True,
    prefill_order="all_heads",
    linear_max_rows=1,
    linear_max_weight_bytes=64 << 20,
    linear_fma=LinearTiles(16, 512, 4, 2, 1),
    linear_dot=LinearTiles(128, 128, 2, 3, 1),
    moe_small=MoeTiles(16, 32, 128, 4, 4),
    moe_large=MoeTiles(64, 128, 64, 4, 3),
    fp8_dot=True,
    fp8_one_row=LinearTiles(8, 1024, 4, 3, 1),
)
#: NVIDIA Ampere data-centre parts (sm_80, sm_87: 163 KiB of shared memory a block, no TMA): the kernels'
#: pre-Hopper configuration, as measured on the H200 before the Hopper target (128 x 64 prefill tiles, 3 stages:
#: Q 32 KiB + 3 x 32 KiB of K/V for bf16 x 128), gathering K/V rows with cp.async;
#: ``fused_moe`` with Hopper's tiles (up to 120 KiB of its 163).
CUDA_AMPERE = TritonTarget(
    "cuda-ampere",
    elementwise_block=2048,
    linear_max_rows=0,
    moe_small=MoeTiles(16, 32, 128, 4, 4),
    moe_large=MoeTiles(64, 128, 64, 4, 3),
)
#: NVIDIA parts with at most 99 KiB of shared memory a block (sm_86, sm_89, sm_120: consumer Ampere, Ada,
#: consumer Blackwell): 64 x 64 prefill tiles over 4 warps, 2 stages (16 + 2 x 32 KiB for bf16 x 128). ``target_for``
#: drops to one stage where even that does not fit (Turing's 64 KiB). ``fused_moe`` keeps the default tiles (two
#: stages of 20 and 24 KiB).
CUDA_COMPACT = TritonTarget(
    "cuda-compact",
    elementwise_block=2048,
    attn_block_m=64,
    attn_block_n=64,
    attn_warps=4,
    attn_stages=2,
    linear_max_rows=0,
)
