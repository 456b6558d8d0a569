"""Launch choices of one GPU family for the shared Triton kernels.

The kernels (:mod:`vllm_port.kernels.triton`) are written once; a plugin passes the
:class:`TritonTarget` of its hardware, and each launcher derives block sizes, warps and pipeline
stages from it. A vendor tunes its target, not the kernels, and keeps it in its plugin
(``vllm_port_cuda.triton_targets``, ``vllm_port_rocm.triton_targets``, ``vllm_port_xpu.triton_targets``);
core keeps only the :data:`INTERPRETER` target of the CPU-interpreter tests. Plain data, outside
``kernels.triton``, so that a plugin states its targets without Triton installed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["INTERPRETER", "PREFILL_ORDERS", "LinearTiles", "MatmulTiles", "MoeTiles", "TritonTarget"]


#: The launch orders prefill attention knows (``TritonTarget.prefill_order``).
PREFILL_ORDERS = ("head", "all_heads")


@dataclass(frozen=True)
class LinearTiles:
    """Launch configuration of one path of the skinny ``linear`` kernel (``linear.py``).

    Attributes:
        block_n: output features (weight rows) per program.
        block_k: input features per step of the reduction; ``block_k x itemsize`` bytes of a weight
            row are read per step, so 256 bfloat16 give each thread of a warp a 16-byte vector.
        warps: warps per program.
        stages: software-pipelining depth of the weight loads.
        waves: split the reduction until about this many programs per multiprocessor run (0: never
            split); each split adds a float32 partial-sum write, and the last split of a block reads them all.
    """

    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    waves: int = 4


@dataclass(frozen=True)
class MoeTiles:
    """Launch configuration of the grouped GEMMs of ``fused_moe`` (``moe.py``).

    Attributes:
        block_m: (token, expert) rows per program; each expert's rows are padded to a multiple of it,
            so a program reads one expert's weights. 16 at decode (a few rows per expert), 64+ at prefill.
        block_n: output columns per program (intermediate columns in the gate/up GEMM, hidden in the down).
        block_k: reduction step; ``block_k x itemsize`` bytes of a weight row per step.
        warps: warps per program.
        stages: software-pipelining depth of the loads; each stage holds ``(block_m + 2 * block_n) x block_k``
            elements of the gate/up kernel in shared memory, which must fit the part's (see ``TritonTarget``).
    """

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3


@dataclass(frozen=True)
class MatmulTiles:
    """Launch configuration of one path of the ``fp8_linear`` kernel (``fp8_linear.py``).

    Attributes:
        block_m: rows (tokens) per program; the skinny path pads fewer rows to a power of two >= 16.
        block_n: output features per program.
        block_k: input features per step (at most 128 with per-group scales).
        warps: warps per program.
        stages: software-pipelining depth of the loads.
        waves: split the reduction until about this many programs per multiprocessor run (0: never).
    """

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    waves: int = 0


@dataclass(frozen=True)
class TritonTarget:
    """Launch configuration of one GPU family.

    Attributes:
        name: a label for reports (``"cuda"``, ``"rocm"``...).
        warp_size: threads that execute in lock step: 32 on NVIDIA, 64 on AMD CDNA, 16/32 on Intel.
        max_warps: the most warps one row kernel (norms, activations) may use.
        elementwise_block: elements one program handles in flat element-wise kernels.
        attn_block_m: query rows per program in prefill attention.
        attn_block_n: keys per step in prefill and decode attention.
        attn_warps: warps per attention program.
        attn_stages: software-pipelining depth of attention's K/V loads.
        decode_block_n: keys per step in decode attention (0: ``attn_block_n``).
        decode_warps: warps per decode-attention program (its score tile is only ``[16, block_n]``).
        decode_stages: pipelining depth of decode's K/V loads (0: ``attn_stages``).
        decode_programs_per_sm: decode splits each sequence's keys (flash-decoding) until about this
            many programs per multiprocessor run; more keep more loads in flight at small batch.
        decode_min_tiles_per_split: the fewest key tiles a split streams (its partial is merged after).
        decode_tma: decode loads K/V tiles with TMA descriptors where every key tile lies inside one
            cache block (as ``prefill_tma``). Needs the tensor memory accelerator (sm_90+).
        prefill_tma: prefill loads K/V tiles with TMA descriptors where every key tile lies inside one
            cache block (block size a multiple of ``attn_block_n``); otherwise it gathers rows. Needs sm_90+.
        prefill_order: how prefill's programs are launched, heaviest query blocks first either way: ``"head"``
            one query head's blocks, then the next head's; ``"all_heads"`` every head's heaviest block before
            any head's lighter ones (the shortest tail; at long context, all heads' keys share the L2).
        linear_max_rows: the most rows (product of ``x``'s leading dimensions) the split-K ``linear``
            kernel serves; more go to the vendor BLAS (``F.linear``). 0 declines ``linear`` at bind time.
        linear_max_weight_bytes: the largest weight (in bytes) the kernel serves, 0 for any; larger ones go
            to the vendor BLAS, where it streams them as fast (measured per target).
        linear_fma: tiles of the vector-unit path that serves one row (a matrix-vector product);
            None sends one row to the tensor-core path too.
        linear_dot: tiles of the tensor-core path (``tl.dot``, rows padded to 16).
        moe_small: tiles of ``fused_moe``'s grouped GEMMs for batches of at most ``moe_small_tokens`` tokens
            (decode: each active expert's weights read once, by many narrow programs).
        moe_large: its tiles for larger batches (prefill: a grouped GEMM of wide tiles).
        moe_small_tokens: the most tokens ``moe_small`` serves.
        moe_route_small: a decode step's routing (top-k, weights) and pair sort run in one Triton program
            (``moe.route_and_sort``); False: ``route``'s torch ops, then the sort.
        fp8_skinny_rows: the most rows ``fp8_linear`` runs with ``fp8_skinny`` (split-K, decode); more take
            ``fp8_wide``. 0 declines ``fp8_linear`` at bind time.
        fp8_skinny: tiles of ``fp8_linear`` at decode.
        fp8_wide: tiles of ``fp8_linear`` at prefill.
        fp8_dot: the GPU multiplies e4m3 operands in ``tl.dot`` (sm_89 and newer); otherwise they are widened to
            bfloat16 first (exact), the weight still read at one byte an element.
        fp8_one_row: tiles of ``linear``'s one-row kernel for ``fp8_linear`` of one row with a per-tensor or
            per-channel scale (the weight widened in registers, no activation quantisation, one launch);
            None: one row takes ``fp8_skinny``.
    """

    name: str
    warp_size: int = 32
    max_warps: int = 16
    elementwise_block: int = 1024
    attn_block_m: int = 128
    attn_block_n: int = 64
    attn_warps: int = 8
    attn_stages: int = 3
    decode_block_n: int = 0
    decode_warps: int = 4
    decode_stages: int = 0
    decode_programs_per_sm: int = 4
    decode_min_tiles_per_split: int = 4
    decode_tma: bool = False
    prefill_tma: bool = False
    prefill_order: str = "head"
    linear_max_rows: int = 16
    linear_max_weight_bytes: int = 0
    linear_fma: LinearTiles | None = LinearTiles(32, 256, 4, 3, 4)
    linear_dot: LinearTiles = LinearTiles(32, 256, 4, 3, 4)
    # shared memory per stage of the gate/up kernel: (block_m + 2 * block_n) * block_k * itemsize; the defaults
    # take 40 and 48 KiB in bfloat16 (two stages), inside the 64 KiB of an AMD CDNA compute unit's LDS
    moe_small: MoeTiles = MoeTiles(16, 32, 128, 4, 2)
    moe_large: MoeTiles = MoeTiles(64, 64, 64, 4, 2)
    moe_small_tokens: int = 64
    moe_route_small: bool = True
    fp8_skinny_rows: int = 64
    fp8_skinny: MatmulTiles = MatmulTiles(16, 64, 256, 4, 4, 4)
    fp8_wide: MatmulTiles = MatmulTiles(128, 128, 128, 8, 3)
    fp8_dot: bool = False
    fp8_one_row: LinearTiles | None = None

    def __post_init__(self) -> None:
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"TritonTarget {self.name!r}: prefill_order must be one of {', '.join(PREFILL_ORDERS)}, "
                f"got {self.prefill_order!r}"
            )


#: The CPU interpreter (TRITON_INTERPRET=1) used by CI: small tiles keep it fast (and make small
#: test shapes cross tile edges and split the reduction).
INTERPRETER = TritonTarget(
    "interpreter",
    max_warps=4,
    elementwise_block=256,
    attn_block_m=16,
    attn_block_n=16,
    attn_warps=4,
    attn_stages=1,
    linear_fma=LinearTiles(16, 32, 4, 1),
    linear_dot=LinearTiles(16, 32, 4, 1),
    moe_small=MoeTiles(16, 16, 16, 4, 1),
    moe_large=MoeTiles(32, 32, 32, 4, 1),
    moe_small_tokens=8,
    fp8_skinny_rows=16,
    fp8_skinny=MatmulTiles(16, 32, 64, 4, 1, 4),
    fp8_wide=MatmulTiles(32, 32, 64, 4, 1),
    fp8_one_row=LinearTiles(16, 32, 4, 1),
)
