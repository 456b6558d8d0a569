"""The split-K Triton ``linear`` for skinny inputs against the op contract and the float64 reference.

Without a GPU the kernel runs in Triton's CPU interpreter (see conftest.py) with the interpreter
target's small tiles, so shapes of a few hundred features cross tile edges, pad rows, and split the
reduction (the interpreter pretends to have 4 multiprocessors). The op's Llama-sized samples are
left to GPU runs there. Both paths are exercised: one row on vector units, more on ``tl.dot``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton import providers  # noqa: E402
from vllm_port.kernels.triton.linear import LinearKernels, _arrival_counts, _splits  # noqa: E402
from vllm_port.kernels.triton_target import INTERPRETER  # noqa: E402
from vllm_port.ops import ALL_OPS, BindContext, OpRegistry, Provider, linear  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402
from vllm_port_rocm.triton_targets import ROCM  # noqa: E402
from vllm_port_xpu.triton_targets import XPU  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if torch.cuda.is_available() and not INTERPRETED:
    DEVICE = torch.device("cuda")
    NATIVE = ROCM if torch.version.hip else CUDA
else:
    DEVICE, NATIVE = torch.device("cpu"), INTERPRETER
# a target that keeps its BLAS for some calls (CUDA serves one row and weights up to 64 MiB): the tests run
# the kernel on every call it could serve, with the target's tiles
NATIVE = dataclasses.replace(NATIVE, linear_max_rows=16, linear_max_weight_bytes=0)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernels(target=NATIVE, **knobs) -> LinearKernels:
    return LinearKernels(dataclasses.replace(target, **knobs) if knobs else target)


def parts(m: int, k: int, n: int, dtype: torch.dtype, bias: bool = False, seed: int = 0):
    """``x [m, k]``, ``weight [n, k]`` scaled to unit outputs, and a bias or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    return x, w, b


def check(fn, args, dtype):
    """``linear.check`` (float64 reference, error statistics, contiguous output) with a readable failure."""
    problem = linear.check(fn, args, dtype)
    assert problem is None, problem


# ------------------------------------------------------------------------------------------------
# The contract and registration
# ------------------------------------------------------------------------------------------------


def test_signature_equals_the_reference_and_registers():
    method = kernels().linear
    assert inspect.signature(method, eval_str=True) == linear.signature
    OpRegistry(ALL_OPS).register(Provider("linear", "triton_linear", method, 20), plugin="test", platform="gpu")


@pytest.mark.parametrize(
    ("target", "bound"),
    [(dataclasses.replace(ROCM, linear_max_rows=16), "triton_linear"), (CUDA, "triton_linear"), (ROCM, "reference")],
    ids=["enabled", "cuda", "rocm"],
)
def test_binding_takes_it_where_the_target_enables_it(target, bound):
    """A target binds the kernel when it enables it (CUDA: measured faster than cuBLAS on an H200); ROCm keeps
    its BLAS until the kernel is measured there."""
    registry = OpRegistry(ALL_OPS)
    for p in providers(target, 20):
        registry.register(p, plugin="test", platform="gpu")
    chosen = registry.bind(BindContext("gpu", "cuda", torch.bfloat16)).providers["linear"]
    assert chosen.name == bound


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_samples_are_within_tolerance(dtype):
    """The op's samples; under the interpreter the ones of at most 256 x 512 weights (GPU runs take the rest)."""
    found = linear.samples(dtype, DEVICE, torch.Generator().manual_seed(0))
    small = [s for s in found if not INTERPRETED or s.args[1].numel() <= 256 * 512]
    assert len(small) >= 4
    for sample in small:
        assert linear.check(kernels().linear, sample.args, dtype) is None, sample.label


def test_error_inputs_raise():
    fn = kernels().linear
    for case in linear.errors(DEVICE):
        with pytest.raises(OpInputError, match=re.escape(case.match)):
            fn(*case.args)


# ------------------------------------------------------------------------------------------------
# Rows, tile edges, both paths, split reductions
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_with_features_off_the_tile_edges(dtype, rows, bias):
    """K = 200 and N = 40: neither a multiple of any target's tiles; the interpreter splits K 3 ways."""
    check(kernels().linear, parts(rows, 200, 40, dtype, bias), dtype)


@pytest.mark.parametrize("on_vector_units", [True, False], ids=["vector units", "tensor cores"])
def test_one_row_on_either_path(on_vector_units):
    """One row goes to vector units, or with ``linear_fma=None`` to tensor cores as more rows do."""
    fn = kernels(linear_fma=INTERPRETER.linear_fma if on_vector_units else None).linear
    for dtype in DTYPES:
        check(fn, parts(1, 136, 72, dtype, bias=True), dtype)


@pytest.mark.slow
def test_split_reductions_agree_and_repeat_bitwise():
    """Split counts (none, uneven, one tile each) are within tolerance, and each repeats bit for bit.

    16 x 512 -> 256 gives the error statistics 4096 outputs: partial sums rounded to bfloat16 raise the
    mean error 1.6x (no bias here, whose magnitude would hide part of it).
    """
    dtype = torch.bfloat16
    x, w, b = parts(16, 512, 256, dtype)
    lin = kernels()
    k_tiles = triton.cdiv(512, NATIVE.linear_dot.block_k)
    for split_k in (1, 3, k_tiles):

        def run(x, weight, bias, split_k=split_k):
            return lin._launch(x, weight, bias, split_k=split_k)

        check(run, (x, w, b), dtype)
        assert torch.equal(run(x, w, b), run(x, w, b)), split_k
    # the last split of each block reset its arrival count: the next call starts from zeros
    assert not _arrival_counts[x.device].any()


def test_zero_rows_and_zero_features():
    fn = kernels().linear
    for x, w in [
        (torch.randn(0, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)),
        (torch.randn(2, 0, 32, device=DEVICE), torch.randn(8, 32, device=DEVICE)),
        (torch.randn(3, 32, device=DEVICE), torch.randn(0, 32, device=DEVICE)),
        (torch.randn(3, 0, device=DEVICE), torch.randn(8, 0, device=DEVICE)),
    ]:
        out = fn(x, w, None)
        assert out.shape == (*x.shape[:-1], w.shape[0]) and torch.equal(out, F.linear(x, w))


# ------------------------------------------------------------------------------------------------
# Strided views
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_views(dtype):
    """x sliced from wider rows, column-major, or 3-D with uncollapsible leading dims; weight transposed or
    a slice of a wider matrix; bias with stride 2."""
    x, w, b = parts(5, 96, 72, dtype, bias=True)
    wide_x = torch.cat([x, x, x], dim=1)[:, 96:192]
    column_major_x = x.t().contiguous().t()
    x3 = x[:4].reshape(2, 2, 96)
    uncollapsible_x = torch.cat([x3, x3], dim=1)[:, :2]
    transposed_w = w.t().contiguous().t()
    sliced_w = torch.cat([w, w], dim=1)[:, 40:136]
    spread_b = torch.stack([b, b], dim=-1)[:, 0]
    fn = kernels().linear
    for args in [
        (wide_x, w, b),
        (column_major_x, w, None),
        (column_major_x[:1], w, b),  # one row (vector units) whose features are 5 apart
        (uncollapsible_x, w, b),
        (x, transposed_w, b),
        (x[:1], transposed_w, None),
        (x, sliced_w, spread_b),
    ]:
        check(fn, args, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("target", [INTERPRETER, CUDA, ROCM, XPU], ids=lambda t: t.name)
def test_every_targets_tiles(target):
    """Each target's tiles (ROCm's and XPU's enabled for the test) on one and several rows."""
    fn = kernels(target, linear_max_rows=16).linear
    for rows in (1, 6):
        check(fn, parts(rows, 300, 80, torch.bfloat16, bias=True), torch.bfloat16)


# ------------------------------------------------------------------------------------------------
# Which calls the kernel serves, and how it splits
# ------------------------------------------------------------------------------------------------


def test_calls_it_does_not_serve_go_to_torch(monkeypatch):
    """17 rows (and float64, and a weight with no unit stride) decline, and the answer is still right."""
    lin = kernels()
    x, w, _ = parts(17, 64, 24, torch.float32)
    assert lin.serves(x[:16], w) and lin.serves(x[:16].reshape(4, 4, 64), w)
    x18 = torch.randn(2, 9, 64, device=DEVICE)
    declined = [(x, w), (x18, w), (x[:4].double(), w.double()), (x[:4], torch.cat([w, w], dim=1)[:, ::2])]
    monkeypatch.setattr(LinearKernels, "_launch", lambda *a, **k: pytest.fail("the kernel was launched"))
    for args in declined:
        assert not lin.serves(*args)
        torch.testing.assert_close(lin.linear(*args, None), F.linear(*args), rtol=0, atol=0)
    assert not kernels(ROCM).serves(x[:1], w)  # linear_max_rows=0


@pytest.mark.parametrize("num_sms", [4, 132, 304])
@pytest.mark.parametrize("waves", [0, 1, 4])
def test_splits_fill_the_device_and_cover_every_tile_once(num_sms, waves):
    for n_blocks in (1, 3, 64, 128, 192, 896, 4008):
        for k_tiles in (1, 3, 4, 16, 56, 64, 1000):
            split, tiles = _splits(n_blocks, k_tiles, num_sms, waves)
            assert (split - 1) * tiles < k_tiles <= split * tiles  # every tile in exactly one split, none empty
            if split > 1:  # only as many splits as fill the device, each of 2 tiles or more
                assert 2 <= tiles and split <= min(32, triton.cdiv(waves * num_sms, n_blocks))
            else:
                assert n_blocks >= waves * num_sms or k_tiles < 4


def test_llama3_8b_decode_on_an_h200_splits_only_narrow_shards():
    """CUDA's one-row tiles on 132 SMs: Llama-3-8B's products fill the device unsplit; its qkv shard at
    tensor-parallel 8 (768 outputs, 48 blocks) splits 3 ways."""
    tiles = CUDA.linear_fma
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    shapes["lm_head"], shapes["qkv / 8"] = (128256, 4096), (768, 4096)
    found = {
        name: _splits(triton.cdiv(n, tiles.block_n), triton.cdiv(k, tiles.block_k), 132, tiles.waves)[0]
        for name, (n, k) in shapes.items()
    }
    assert found == {"qkv": 1, "o": 1, "gate_up": 1, "down": 1, "lm_head": 1, "qkv / 8": 3}


def test_cuda_serves_one_row_and_weights_up_to_64_mib():
    """Where cuBLAS measured as fast (more rows, larger weights), CUDA's target leaves the call to it."""
    cuda = LinearKernels(CUDA)
    meta = torch.device("meta")
    x1, x2 = torch.empty(1, 4096, device=meta), torch.empty(2, 4096, device=meta)
    o_proj, gate_up = torch.empty(4096, 4096, device=meta), torch.empty(28672, 4096, device=meta)
    assert cuda.serves(x1.bfloat16(), o_proj.bfloat16())  # 32 MiB
    assert not cuda.serves(x2.bfloat16(), o_proj.bfloat16())  # two rows
    assert not cuda.serves(x1.bfloat16(), gate_up.bfloat16())  # 224 MiB
    assert cuda.serves(x1, torch.empty(4096, 4096, device=meta))  # float32: 64 MiB, at the cap
    assert not cuda.serves(x1, torch.empty(4097, 4096, device=meta))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="synchronisation debug mode needs a CUDA device")
def test_launcher_does_not_synchronise_with_the_host():
    fn = kernels().linear
    for rows in (1, 8):
        args = parts(rows, 4096, 4096, torch.bfloat16, bias=True)
        fn(*args)  # compile first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
