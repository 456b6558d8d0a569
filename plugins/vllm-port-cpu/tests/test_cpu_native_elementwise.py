"""The native element-wise kernels (``vllm_port_cpu.native_elementwise``) against the float64 reference, and their fallback.

The op samples run on every CPU provider in ``test_cpu_ops.py`` too; here each runs with the torch
provider out of reach, so the kernel itself answers, plus the shapes that matter to its loops: no
rows, widths around its 32 partial sums and 512-feature buffers, rows addressed by two strides,
partial rotary in both layouts, every table dtype; then what it leaves to the torch provider and
what happens with the kernels off.
"""

import pytest
import torch

from vllm_port.errors import OpInputError
from vllm_port.ops import ALL_OPS, BindContext, OpRegistry
from vllm_port.ops.rotary import make_cos_sin_cache
from vllm_port_cpu import native, native_elementwise, ops

OPS = {op.name: op for op in ALL_OPS}
NAMES = ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CPU = torch.device("cpu")
by_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
needs_kernels = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.status}")


def _no_torch_provider(name):
    raise AssertionError(f"the kernel left {name} to the torch provider")


@pytest.fixture
def kernel_only(monkeypatch):
    """The kernels must answer: asking for the torch provider fails the test."""
    monkeypatch.setattr(native_elementwise, "_torch_provider", _no_torch_provider)


def check(name, args, dtype):
    """The native provider of op ``name`` on ``args`` against the float64 reference (``Op.check``)."""
    problem = OPS[name].check(getattr(native_elementwise, name).fn, args, dtype)
    assert problem is None, problem


def rows(*shape, dtype, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@needs_kernels
@by_dtype
@pytest.mark.parametrize("name", NAMES)
def test_contract_samples_match_the_float64_reference_in_the_kernel(name, dtype, kernel_only):
    for sample in OPS[name].samples(dtype, CPU, torch.Generator().manual_seed(0)):
        problem = OPS[name].check(getattr(native_elementwise, name).fn, sample.args, dtype)
        assert problem is None, f"{sample.label}: {problem}"


# widths around the 32 partial sums, the 512-feature float16 buffers, and one of each parity
WIDTHS = [1, 3, 31, 32, 33, 511, 513, 1025]


@needs_kernels
@by_dtype
@pytest.mark.parametrize("width", WIDTHS)
def test_norms_at_odd_widths(dtype, width, kernel_only):
    x, weight = rows(5, width, dtype=dtype), 1 + rows(width, dtype=dtype, seed=1, scale=0.1)
    check("rms_norm", (x, weight, 1e-6), dtype)
    check("fused_add_rms_norm", (x, rows(5, width, dtype=dtype, seed=2), weight, 1e-6), dtype)


@needs_kernels
@by_dtype
def test_norms_of_no_rows_return_empty_and_write_nothing(dtype, kernel_only):
    x, weight = rows(0, 64, dtype=dtype), torch.ones(64, dtype=dtype)
    assert native_elementwise.rms_norm.fn(x, weight, 1e-6).shape == (0, 64)
    residual = rows(0, 64, dtype=dtype)
    assert native_elementwise.fused_add_rms_norm.fn(x, residual, weight, 1e-6).shape == (0, 64)
    check("rms_norm", (rows(2, 0, 64, dtype=dtype), weight, 1e-6), dtype)


@needs_kernels
@by_dtype
def test_norms_of_rows_two_strides_apart(dtype, kernel_only):
    # Qwen3's per-head norms: [tokens, heads, head_size] views of a fused qkv row
    qkv = rows(6, (8 + 2 * 2) * 64, dtype=dtype)
    q = qkv[:, : 8 * 64].unflatten(-1, (8, 64))
    weight = 1 + rows(64, dtype=dtype, seed=1, scale=0.1)
    assert native_elementwise._rows(q) == (6, 8, qkv.shape[1], 64)
    check("rms_norm", (q, weight, 1e-6), dtype)
    residual = rows(6, 8, 2 * 64, dtype=dtype, seed=3)[..., 64:]  # the residual stream a view too
    check("fused_add_rms_norm", (q, residual, weight, 1e-6), dtype)
    four = rows(2, 3, 4, 80, dtype=dtype)[..., :64]  # 4 dimensions whose leading two flatten
    check("rms_norm", (four, weight, 1e-6), dtype)
    check("fused_add_rms_norm", (four, rows(2, 3, 4, 64, dtype=dtype), weight, 1e-6), dtype)


@needs_kernels
@by_dtype
def test_fused_add_with_x_the_residual_itself(dtype, kernel_only):
    residual = rows(4, 96, dtype=dtype)
    check("fused_add_rms_norm", (residual, residual, torch.ones(96, dtype=dtype), 1e-6), dtype)


@needs_kernels
@by_dtype
@pytest.mark.parametrize("width", [1, 7, 33, 513, 1001])
def test_silu_and_mul_at_odd_widths_and_strided_rows(dtype, width, kernel_only):
    check("silu_and_mul", (rows(3, 2 * width, dtype=dtype, scale=3.0),), dtype)
    check("silu_and_mul", (rows(3, 3 * width, dtype=dtype, scale=3.0)[:, : 2 * width],), dtype)
    check("silu_and_mul", (rows(2, 3, 2 * width, dtype=dtype, scale=3.0),), dtype)
    assert native_elementwise.silu_and_mul.fn(rows(0, 2 * width, dtype=dtype)).shape == (0, width)


@needs_kernels
@by_dtype
def test_silu_and_mul_of_non_finite_and_extreme_gates_is_the_torch_providers(dtype, kernel_only):
    gate = torch.tensor([-float("inf"), -1e4, -104.0, -88.0, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 1e4])
    gate = torch.cat([gate, torch.tensor([float("inf"), float("nan")])]).to(dtype)
    x = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    got, want = native_elementwise.silu_and_mul.fn(x), ops.silu_and_mul.fn(x)
    assert torch.equal(got.isnan(), want.isnan())  # silu(-inf) is NaN, as torch's -inf / inf
    torch.testing.assert_close(got, want, equal_nan=True, atol=1e-30, rtol=OPS["silu_and_mul"].tolerances[dtype].rtol)


def _rotary_args(tokens, heads, kv_heads, head_size, rot, neox, dtype, *, fused=False, three_d=False, table=None):
    gen = torch.Generator().manual_seed(tokens + rot)
    positions = torch.randint(0, 1024, (tokens,), generator=gen)
    if fused:  # query and key as slices of one [tokens, (heads + 2 kv_heads) * head_size] projection
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
        q, k = qkv[:, : heads * head_size], qkv[:, heads * head_size : (heads + kv_heads) * head_size]
    else:
        q = torch.randn(tokens, heads * head_size, generator=gen).to(dtype)
        k = torch.randn(tokens, kv_heads * head_size, generator=gen).to(dtype)
    if three_d:
        q, k = q.unflatten(-1, (heads, head_size)), k.unflatten(-1, (kv_heads, head_size))
    cache = make_cos_sin_cache(1024, rot) if table is None else table
    return positions, q, k, head_size, cache, neox


@needs_kernels
@by_dtype
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gpt-j"])
@pytest.mark.parametrize(("head_size", "rot"), [(64, 64), (64, 32), (80, 32), (128, 2), (256, 256), (96, 94)])
def test_rotary_layouts_and_partial_rotary(dtype, neox, head_size, rot, kernel_only):
    check("rotary_embedding", _rotary_args(5, 4, 2, head_size, rot, neox, dtype), dtype)
    check("rotary_embedding", _rotary_args(3, 4, 2, head_size, rot, neox, dtype, fused=True), dtype)
    check("rotary_embedding", _rotary_args(3, 4, 2, head_size, rot, neox, dtype, fused=True, three_d=True), dtype)


@needs_kernels
@by_dtype
def test_rotary_of_no_tokens_and_strided_positions_and_every_table_dtype(dtype, kernel_only):
    check("rotary_embedding", _rotary_args(0, 4, 2, 64, 64, True, dtype), dtype)
    positions, q, k, head_size, cache, neox = _rotary_args(6, 4, 2, 64, 64, True, dtype)
    every_other = torch.stack([positions.to(torch.int32), positions.to(torch.int32)], dim=1)[:, 0]
    assert every_other.stride(0) == 2
    check("rotary_embedding", (every_other, q, k, head_size, cache, neox), dtype)
    for table in (torch.float32, torch.bfloat16, torch.float16):
        wide = make_cos_sin_cache(1024, 64).to(table)
        check("rotary_embedding", (positions, q, k, head_size, wide, neox), dtype)
    strided = torch.cat([cache, cache], dim=1)[:, :64]  # table rows 128 apart
    check("rotary_embedding", (positions, q, k, head_size, strided, neox), dtype)


@needs_kernels
def test_rotary_positions_past_the_table_raise_before_anything_is_written(kernel_only):
    positions, q, k, head_size, cache, neox = _rotary_args(4, 4, 2, 64, 64, True, torch.float32)
    positions[2] = cache.shape[0]
    before = (q.clone(), k.clone())
    with pytest.raises(OpInputError, match=r"positions\[2\] is 1024, outside \[0, 1024\)"):
        native_elementwise.rotary_embedding.fn(positions, q, k, head_size, cache, neox)
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])
    positions[2] = -1
    with pytest.raises(OpInputError, match=r"positions\[2\] is -1"):
        native_elementwise.rotary_embedding.fn(positions, q, k, head_size, cache, neox)


@needs_kernels
def test_inputs_the_kernels_do_not_cover_go_to_the_torch_provider(monkeypatch):
    asked = []
    monkeypatch.setattr(native_elementwise, "_torch_provider", lambda name: asked.append(name) or getattr(ops, name))
    doubles = (rows(4, 128, dtype=torch.float64), torch.ones(128, dtype=torch.float64), 1e-6)
    torch.testing.assert_close(native_elementwise.rms_norm.fn(*doubles), OPS["rms_norm"].reference(*doubles))
    columns = rows(4, 256, dtype=torch.float32)[:, ::2]  # last dimension not contiguous
    check("fused_add_rms_norm", (columns, rows(4, 128, dtype=torch.float32), torch.ones(128), 1e-6), torch.float32)
    check("silu_and_mul", (rows(3, 256, dtype=torch.float32)[:, ::2],), torch.float32)
    unflattened = rows(2, 4, 3, 64, dtype=torch.float32).transpose(1, 2)  # 4 dims whose leading ones don't flatten
    check("rms_norm", (unflattened, torch.ones(64), 1e-6), torch.float32)
    args = _rotary_args(3, 4, 2, 64, 64, True, torch.bfloat16, table=make_cos_sin_cache(1024, 64, dtype=torch.float64))
    check("rotary_embedding", args, torch.bfloat16)
    assert asked == ["rms_norm", "fused_add_rms_norm", "silu_and_mul", "rms_norm", "rotary_embedding"]


def _bound(dtype):
    registry = OpRegistry(ALL_OPS)
    for p in ops.PROVIDERS:
        registry.register(p, plugin="cpu", platform="cpu")
    chosen = registry.bind(BindContext("cpu", "cpu", dtype)).providers
    return {name: chosen[name].name for name in NAMES}


@pytest.fixture
def switched_off(fresh_state, monkeypatch):
    """The module as in a new process with ``VLLM_PORT_CPU_NATIVE=0``."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")


@by_dtype
def test_with_the_kernels_off_the_torch_providers_bind_and_serve(dtype, switched_off):
    assert _bound(dtype) == {name: f"cpu_{name}" for name in NAMES}
    x, weight = rows(3, 64, dtype=dtype), torch.ones(64, dtype=dtype)
    check("rms_norm", (x, weight, 1e-6), dtype)  # the provider itself, called anyway, falls back
    check("fused_add_rms_norm", (x, rows(3, 64, dtype=dtype, seed=1), weight, 1e-6), dtype)
    check("silu_and_mul", (x,), dtype)
    check("rotary_embedding", _rotary_args(3, 4, 2, 64, 32, False, dtype), dtype)


@needs_kernels
@by_dtype
def test_with_the_kernels_on_they_bind_above_the_torch_providers(dtype):
    assert _bound(dtype) == {name: f"cpu_native_{name}" for name in NAMES}
