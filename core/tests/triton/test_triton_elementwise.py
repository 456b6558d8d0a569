"""The element-wise Triton kernels (norms, gated activations, rotary, KV-cache writes) against the op contract.

Without a GPU the kernels run in Triton's CPU interpreter (see conftest.py) on CPU tensors; the
prefill-sized samples are left to GPU runs there, as the interpreter executes programs one by one.
Every target's launch configuration (block sizes, warps) is exercised, since the CUDA, ROCm and XPU
plugins launch the same kernels with their own.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from vllm_port.errors import OpInputError  # noqa: E402
from vllm_port.kernels.triton.activation import ActivationKernels  # noqa: E402
from vllm_port.kernels.triton.cache import CacheKernels  # noqa: E402
from vllm_port.kernels.triton.norm import NormKernels  # noqa: E402
from vllm_port.kernels.triton.rotary import RotaryKernels  # noqa: E402
from vllm_port.kernels.triton_target import INTERPRETER, TritonTarget  # noqa: E402
from vllm_port.ops import (  # noqa: E402
    ALL_OPS,
    Op,
    OpRegistry,
    Provider,
    fused_add_rms_norm,
    gelu_and_mul,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from vllm_port.ops.rotary import make_cos_sin_cache  # noqa: E402
from vllm_port_cuda.triton_targets import CUDA  # noqa: E402
from vllm_port_rocm.triton_targets import ROCM  # noqa: E402
from vllm_port_xpu.triton_targets import XPU  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
if torch.cuda.is_available() and not INTERPRETED:
    DEVICE = torch.device("cuda")
    NATIVE = ROCM if torch.version.hip else CUDA
elif hasattr(torch, "xpu") and torch.xpu.is_available() and not INTERPRETED:
    DEVICE, NATIVE = torch.device("xpu"), XPU
else:
    DEVICE, NATIVE = torch.device("cpu"), INTERPRETER

CLASSES = (NormKernels, ActivationKernels, RotaryKernels, CacheKernels)
OPS = (rms_norm, fused_add_rms_norm, silu_and_mul, gelu_and_mul, rotary_embedding, reshape_and_cache)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TARGETS = (INTERPRETER, CUDA, ROCM, XPU)
NAN = float("nan")


def kernel(op: Op, target: TritonTarget = NATIVE):
    """The bound method serving ``op`` for ``target``."""
    cls = next(c for c in CLASSES if op.name in c.OPS)
    return getattr(cls(target), op.name)


def samples(op: Op, dtype: torch.dtype, seed: int = 0):
    """The op's samples; under the interpreter, without the prefill-sized and ``large`` ones (GPU runs take them)."""
    found = op.samples(dtype, DEVICE, torch.Generator().manual_seed(seed))
    return [s for s in found if not (INTERPRETED and ("prefill" in s.label or s.large))]


def padded(t: torch.Tensor, pad: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s values in a view whose rows sit further apart than their length, inside a NaN-filled buffer."""
    buf = torch.full((*t.shape[:-1], t.shape[-1] + 2 * pad), NAN, dtype=t.dtype, device=t.device)
    view = buf[..., pad : pad + t.shape[-1]]
    view.copy_(t)
    return view, buf


def column_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with the last dimension not contiguous."""
    return t.movedim(-1, 0).contiguous().movedim(0, -1)


def padding_untouched(buf: torch.Tensor, pad: int = 3) -> bool:
    return bool(buf[..., :pad].isnan().all() and buf[..., -pad:].isnan().all())


# ------------------------------------------------------------------------------------------------
# The contract: signatures, samples, errors, every target
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_signature_equals_the_reference_and_registers(op):
    method = kernel(op)
    assert inspect.signature(method, eval_str=True) == op.signature
    registry = OpRegistry(ALL_OPS)
    registry.register(Provider(op.name, f"triton_{op.name}", method, 20), plugin="test", platform="gpu")


def test_every_class_names_its_ops():
    assert sorted(op for cls in CLASSES for op in cls.OPS) == sorted(op.name for op in OPS)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_samples_are_within_tolerance(op, dtype):
    fn = kernel(op)
    for sample in samples(op, dtype):
        assert op.check(fn, sample.args, dtype) is None, sample.label


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_small_samples_with_every_target(op, target):
    fn = kernel(op, target)
    for sample in op.samples(torch.bfloat16, DEVICE, torch.Generator().manual_seed(1))[:2]:
        assert op.check(fn, sample.args, torch.bfloat16) is None, sample.label


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_error_inputs_raise(op):
    fn = kernel(op)
    for case in op.errors(DEVICE):
        with pytest.raises(OpInputError, match=re.escape(case.match)):
            fn(*case.args)


@triton.jit
def _store_kernel(x_ptr, out_ptr, N: tl.constexpr):  # noqa: N803 - Triton constexpr
    i = tl.arange(0, N)
    tl.store(out_ptr + i, tl.load(x_ptr + i))


def test_bfloat16_stores_round_to_nearest_even_like_gpus():
    """conftest.py makes the interpreter round float32 -> bfloat16 as GPUs do; Op.check's error statistics rely on it."""
    x = 100 * torch.randn(1024, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = torch.empty(1024, dtype=torch.bfloat16, device=DEVICE)
    _store_kernel[(1,)](x, out, N=1024)
    assert torch.equal(out, x.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# Norms
# ------------------------------------------------------------------------------------------------


def norm_args(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, dtype)
    return x, residual, weight


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(3, 1), (5, 3), (9, 100), (2, 3, 1000)], ids=str)
def test_norms_with_any_hidden_size(shape, target):
    """Sizes that are not powers of two, and several rows per program."""
    x, residual, weight = norm_args(shape, torch.bfloat16)
    assert rms_norm.check(kernel(rms_norm, target), (x, weight, 1e-5), torch.bfloat16) is None
    args = (x, residual, weight, 1e-5)
    assert fused_add_rms_norm.check(kernel(fused_add_rms_norm, target), args, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms_of_rows_too_long_for_registers(dtype):
    """Rows past the register-resident size are walked twice, in chunks (the last one partial)."""
    x, residual, weight = norm_args((3, 20000), dtype)
    assert rms_norm.check(kernel(rms_norm), (x, weight, 1e-5), dtype) is None
    assert fused_add_rms_norm.check(kernel(fused_add_rms_norm), (x, residual, weight, 1e-5), dtype) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_inputs(dtype):
    x, _, weight = norm_args((4, 6, 96), dtype)
    fn = kernel(rms_norm)
    row_gaps, _ = padded(x)
    uncollapsible = torch.cat([x, x], dim=1)[:, :6]  # leading dims that do not merge into one row stride
    spread_weight = torch.stack([weight, weight], dim=-1)[:, 0]  # weight with stride 2
    for args in [(row_gaps, weight), (column_major(x), weight), (uncollapsible, weight), (x, spread_weight)]:
        assert rms_norm.check(fn, (*args, 1e-6), dtype) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["row gaps", "column major"])
def test_fused_add_rms_norm_updates_a_strided_residual_in_place(dtype, layout):
    x, residual, weight = norm_args((5, 80), dtype)
    fn = kernel(fused_add_rms_norm)

    def strided(x, residual, weight, epsilon):
        if layout == "row gaps":
            view, buf = padded(residual)
        else:
            view, buf = column_major(residual), None
        out = fn(padded(x)[0], view, weight, epsilon)
        assert buf is None or padding_untouched(buf)
        residual.copy_(view)  # let check compare what the kernel wrote through the view
        return out

    assert fused_add_rms_norm.check(strided, (x, residual, weight, 1e-6), dtype) is None


# ------------------------------------------------------------------------------------------------
# Gated activations
# ------------------------------------------------------------------------------------------------

GATED = [(silu_and_mul, ()), (gelu_and_mul, ()), (gelu_and_mul, ("tanh",))]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's exp(200)
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("width", [1, 3, 100, 1500])
def test_gated_activations_with_any_width(width, target):
    """Widths that are not powers of two, and one spanning two column blocks on every GPU target (1500)."""
    x = (3 * torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(width))).to(DEVICE, torch.bfloat16)
    for op, extra in GATED:
        assert op.check(kernel(op, target), (x, *extra), torch.bfloat16) is None, (op.name, extra)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_activations_strided_inputs(dtype):
    x = torch.randn(2, 3, 2 * 40, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    uncollapsible = torch.cat([x, x], dim=1)[:, :3]
    for op, extra in GATED:
        fn = kernel(op)
        for strided in (padded(x)[0], column_major(x), uncollapsible, x[0]):
            assert op.check(fn, (strided, *extra), dtype) is None, (op.name, extra)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_gated_activations_saturate_like_the_reference():
    x = torch.tensor([[-200.0, -30.0, 0.0, 30.0, 200.0, 1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    for op, extra in GATED:
        assert op.check(kernel(op), (x, *extra), torch.float32) is None, (op.name, extra)


@pytest.mark.slow
def test_exact_gelu_within_a_few_ulps_of_float64_on_a_dense_grid():
    """The erf GELU (Abramowitz-Stegun 7.1.26 erfc) against float64 torch: absolute error under 1e-6 everywhere."""
    gate = torch.linspace(-20.0, 20.0, 100_000, dtype=torch.float64)
    x = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)  # up = 1: the output is gelu(gate) itself
    got = kernel(gelu_and_mul)(x.float().to(DEVICE)).double().cpu()[0]
    want = torch.nn.functional.gelu(gate)
    assert (got - want).abs().max() < 1e-6


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_exact_gelu_of_special_values_is_float64_torchs():
    gate = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38, -3e38], dtype=torch.float64)
    x = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    got = kernel(gelu_and_mul)(x.float().to(DEVICE)).double().cpu()[0]
    want = torch.nn.functional.gelu(gate)  # gelu(-inf) is NaN here (-inf * 0), as in float64 torch
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0, equal_nan=True)
    assert torch.signbit(got[1]) == torch.signbit(want[1])  # -0.0 keeps its sign


# ------------------------------------------------------------------------------------------------
# Rotary embedding
# ------------------------------------------------------------------------------------------------


def rotary_args(tokens, heads, kv_heads, head_size, rot, dtype, seed=0, pos_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE, pos_dtype)
    q = torch.randn(tokens, heads * head_size, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, kv_heads * head_size, generator=gen).to(DEVICE, dtype)
    return positions, q, k, make_cos_sin_cache(64, rot).to(DEVICE)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gpt-j"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "rot"), [(3, 1, 80, 80), (2, 3, 48, 24), (5, 5, 32, 2)])
def test_rotary_with_any_head_and_rotary_size(heads, kv_heads, head_size, rot, is_neox, target):
    """Rotary halves that are not powers of two, more KV heads than query heads, partial rotary."""
    positions, q, k, cache = rotary_args(3, heads, kv_heads, head_size, rot, torch.bfloat16, pos_dtype=torch.int32)
    args = (positions, q, k, head_size, cache, is_neox)
    assert rotary_embedding.check(kernel(rotary_embedding, target), args, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gpt-j"])
@pytest.mark.parametrize("three_d", [False, True], ids=["2d", "3d"])
def test_rotary_in_place_on_views_of_a_fused_qkv(three_d, is_neox, dtype):
    """query and key as slices of one qkv projection (rows further apart than their length), strided positions and table."""
    heads, kv_heads, head_size = 4, 2, 64
    positions, q, k, cache = rotary_args(5, heads, kv_heads, head_size, 32, dtype)
    fn = kernel(rotary_embedding)

    def on_qkv(positions, query, key, head_size, cos_sin_cache, is_neox):
        tokens, q_width, k_width = query.shape[0], query.shape[1], key.shape[1]
        qkv = torch.full((tokens, q_width + 2 * k_width), NAN, dtype=query.dtype, device=query.device)
        q_view, k_view = qkv[:, :q_width], qkv[:, q_width : q_width + k_width]
        q_view.copy_(query)
        k_view.copy_(key)
        if three_d:
            q_view, k_view = q_view.view(tokens, -1, head_size), k_view.view(tokens, -1, head_size)
        spread_positions = torch.stack([positions, positions], dim=-1)[:, 0]
        spread_cache = padded(cos_sin_cache)[0] if three_d else column_major(cos_sin_cache)
        assert fn(spread_positions, q_view, k_view, head_size, spread_cache, is_neox) is None
        assert qkv[:, q_width + k_width :].isnan().all()  # the value slice is not touched
        query.copy_(q_view.reshape(query.shape))
        key.copy_(k_view.reshape(key.shape))

    assert rotary_embedding.check(on_qkv, (positions, q, k, head_size, cache, is_neox), dtype) is None


# ------------------------------------------------------------------------------------------------
# reshape_and_cache
# ------------------------------------------------------------------------------------------------


def cache_args(tokens, num_blocks, block_size, kv_heads, head_size, dtype, seed=0, slot_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    value_cache = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::3] = -1
    key = torch.randn(tokens, kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    value = torch.randn(tokens, kv_heads, head_size, generator=gen).to(DEVICE, dtype)
    return key, value, key_cache, value_cache, slots.to(DEVICE, slot_dtype)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize(("kv_heads", "head_size"), [(3, 80), (1, 1), (40, 64)])
def test_reshape_and_cache_with_any_head_size(kv_heads, head_size, target):
    """Head sizes that are not powers of two; more heads than one program covers (40 x 64)."""
    fn = kernel(reshape_and_cache, target)
    args = cache_args(7, 3, 4, kv_heads, head_size, torch.bfloat16, slot_dtype=torch.int32)
    assert reshape_and_cache.check(fn, args, torch.bfloat16) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reshape_and_cache_from_qkv_views_into_strided_caches(dtype):
    """key and value sliced out of a qkv projection; caches that are views of a larger buffer."""
    tokens, heads, kv_heads, head_size = 6, 4, 2, 64
    key, value, key_cache, value_cache, slots = cache_args(tokens, 3, 4, kv_heads, head_size, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(DEVICE, dtype)
    k_view = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v_view = qkv[:, (heads + kv_heads) * head_size :].view(tokens, kv_heads, head_size)
    k_view.copy_(key)
    v_view.copy_(value)
    fn = kernel(reshape_and_cache)

    def into_views(key, value, key_cache, value_cache, slot_mapping):
        kc_view, kc_buf = padded(key_cache)
        vc_view, vc_buf = padded(value_cache)
        spread_slots = torch.stack([slot_mapping, slot_mapping], dim=-1)[:, 0]
        assert fn(key, value, kc_view, vc_view, spread_slots) is None
        assert padding_untouched(kc_buf) and padding_untouched(vc_buf)
        key_cache.copy_(kc_view)
        value_cache.copy_(vc_view)

    assert reshape_and_cache.check(into_views, (k_view, v_view, key_cache, value_cache, slots), dtype) is None


def test_reshape_and_cache_skips_every_padding_token():
    key, value, key_cache, value_cache, _ = cache_args(4, 2, 4, 2, 64, torch.float16)
    before = key_cache.clone(), value_cache.clone()
    kernel(reshape_and_cache)(key, value, key_cache, value_cache, torch.full((4,), -1, device=DEVICE))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


# ------------------------------------------------------------------------------------------------
# No tokens; no host synchronisation
# ------------------------------------------------------------------------------------------------


def empty_cases(dtype):
    """Arguments with zero tokens for every op."""
    x, residual, weight = norm_args((0, 64), dtype)
    positions, q, k, rope = rotary_args(0, 4, 2, 64, 64, dtype)
    return {
        "rms_norm": (x, weight, 1e-6),
        "fused_add_rms_norm": (x, residual, weight, 1e-6),
        "silu_and_mul": (torch.empty(0, 128, dtype=dtype, device=DEVICE),),
        "gelu_and_mul": (torch.empty(2, 0, 128, dtype=dtype, device=DEVICE), "tanh"),
        "rotary_embedding": (positions, q, k, 64, rope, True),
        "reshape_and_cache": cache_args(0, 2, 4, 2, 64, dtype),
    }


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_zero_tokens(op):
    for dtype in DTYPES:
        args = empty_cases(dtype)[op.name]
        if op is rotary_embedding:  # the reference's view(tokens, -1, head_size) is ambiguous for 0 tokens
            assert kernel(op)(*args) is None
        else:
            assert op.check(kernel(op), args, dtype) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="synchronisation debug mode needs a CUDA device")
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_launchers_do_not_synchronise_with_the_host(op):
    sample = samples(op, torch.bfloat16)[0]
    fn = kernel(op)
    fn(*sample.args)  # compile first: the first launch may synchronise while loading the module
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(*sample.args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
