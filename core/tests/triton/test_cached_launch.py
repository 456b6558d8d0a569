"""The cached launch of Triton kernels (``kernels/triton/launch.py``): a repeat launch skips Triton's binder only
where Triton would pick the same compiled kernel, and passes what Triton passes.

The key is checked against Triton's own specialisation (``native_specialize_impl``, the function its
binder calls), and the direct launch against a stand-in for Triton's launch path; on a GPU the
conformance suite runs every provider through it (``vllm-port certify cuda``).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton._C.libtriton import native_specialize_impl
from triton.backends.nvidia.compiler import CUDABackend
from triton.knobs import HookChain
from triton.runtime.jit import JITFunction

from vllm_port.kernels.triton import launch
from vllm_port.kernels.triton.launch import CachedLaunch, cached_launch, cdiv, next_power_of_2, specialisation

REPO = Path(__file__).resolve().parents[3]
LAUNCHERS = [
    *sorted((REPO / "core/src/vllm_port/kernels/triton").glob("*.py")),
    REPO / "plugins/vllm-port-cuda/src/vllm_port_cuda/fusions.py",
]


def _arguments() -> list[object]:
    """Arguments of every kind and edge Triton specialises on."""
    base = torch.zeros(64, dtype=torch.float32)
    tensors = [base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32)]
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, 2**31 + 16, 2**32, 2**63 - 1, 2**63, 2**64 - 16]
    return [*tensors, *ints, 0.5, 1.0, True, False, None]


def _triton(arg: object) -> tuple:
    """What Triton's binder keys a compiled kernel on for ``arg``, specialising as much as it ever does."""
    return native_specialize_impl(CUDABackend, arg, False, True, True)


def test_equal_keys_are_equal_to_triton():
    """The key refines Triton's: two arguments with one key always have one Triton specialisation."""
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        if specialisation((a,)) == specialisation((b,)):
            assert _triton(a) == _triton(b), (a, b)


def test_kinds_the_key_does_not_describe_launch_through_triton():
    assert specialisation((torch.zeros(1), (1, 2))) is None
    assert specialisation((torch.float32,)) is None
    assert specialisation((tl.float32,)) is None


def _kernel_fn(x_ptr, n, scale, BLOCK: tl.constexpr, EVEN: tl.constexpr = True):  # noqa: N803
    pass


class _Launcher:
    """Stands in for Triton 3.6's ``CudaLauncher``: ``__call__`` (``CompiledKernel.run``) and its C ``launch``."""

    launch_cooperative_grid, launch_pdl = "coop", "pdl"

    def __init__(self, scratch: int) -> None:
        self.global_scratch_size = self.profile_scratch_size = scratch
        self.calls: list[tuple] = []  # through __call__
        self.launches: list[tuple] = []  # straight to the C launcher

    def __call__(self, *args):
        self.calls.append(args)

    def launch(self, *args):
        self.launches.append(args)


class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, scratch: int = 0) -> None:
        self.run = _Launcher(scratch)

    @property
    def runs(self) -> list[tuple]:
        """Every launch that skipped Triton's binder, by either path."""
        return self.run.calls + self.run.launches


class _Triton:
    """Stands in for ``JITFunction.__getitem__``: records the launches that went through Triton."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, args, kwargs))
            return self.compiled

        return run


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> CachedLaunch:
    """A cached launch of a two-constexpr kernel on a pretend CUDA device 0 whose stream is 77."""
    monkeypatch.setattr(launch, "_on", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    cached = CachedLaunch(JITFunction(_kernel_fn))
    cached.kernel = _Triton()
    return cached


def test_a_repeat_launch_calls_the_c_launcher_with_what_triton_passes(kernel):
    x = torch.zeros(64)
    kernel[(3,)](x, 32, 0.5, BLOCK=16)
    kernel[(5, 2)](x, 48, 0.25, BLOCK=16)  # other values, the same specialisation
    assert len(kernel.kernel.launches) == 1 and not kernel.kernel.compiled.run.calls
    (run,) = kernel.kernel.compiled.run.launches
    # grid, stream, function, cooperative grid and PDL flags, no scratch, metadata, no launch metadata, no hooks
    assert run[:13] == (5, 2, 1, 77, "function", "coop", "pdl", None, None, "metadata", None, None, None)
    assert run[13] is x and run[14:] == (48, 0.25, 16, True)  # a CPU tensor as it is; the keyword, the default


def test_a_kernel_with_scratch_memory_launches_through_its_compiled_kernel(kernel):
    """``CompiledKernel.run`` allocates a kernel's scratch memory on each launch: such a kernel is called there."""
    kernel.kernel.compiled = _Compiled(scratch=256)
    x = torch.zeros(64)
    for n in (32, 48):
        kernel[(3,)](x, n, 0.5, BLOCK=16)
    assert not kernel.kernel.compiled.run.launches
    (run,) = kernel.kernel.compiled.run.calls
    assert run[:9] == (3, 1, 1, 77, "function", "metadata", None, None, None)
    assert run[9] is x and run[10:] == (48, 0.5, 16, True)


def test_another_specialisation_or_keyword_launches_through_triton(kernel):
    x = torch.zeros(64)
    kernel[(1,)](x, 32, 0.5, BLOCK=16)
    kernel[(1,)](x[1:], 32, 0.5, BLOCK=16)  # not 16-byte aligned
    kernel[(1,)](x, 33, 0.5, BLOCK=16)  # not divisible by 16
    kernel[(1,)](x, 1, 0.5, BLOCK=16)  # the value 1, a constant to Triton
    kernel[(1,)](x.half(), 32, 0.5, BLOCK=16)  # another element type
    kernel[(1,)](x, 32, 0.5, BLOCK=32)
    kernel[(1,)](x, 32, 0.5, BLOCK=16, num_warps=8)
    kernel[(1,)](x, 32, 0.5, BLOCK=16, EVEN=1)  # True == 1, but Triton compiles a bool and an int apart
    kernel[(1,)](x, 32, 0.5, BLOCK=16, EVEN=True)
    assert len(kernel.kernel.launches) == 9 and not kernel.kernel.compiled.runs


def test_a_tensor_by_keyword_or_a_launch_hook_always_launches_through_triton(kernel, monkeypatch):
    x = torch.zeros(64)
    for _ in range(2):
        kernel[(1,)](x_ptr=x, n=32, scale=0.5, BLOCK=16)
    assert len(kernel.kernel.launches) == 2 and not kernel._compiled
    kernel[(1,)](x, 32, 0.5, BLOCK=16)
    hooks = HookChain()
    hooks.add(lambda metadata: None)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", hooks)
    kernel[(1,)](x, 32, 0.5, BLOCK=16)
    kernel[(1,)](x, 32, 0.5, BLOCK=64)  # compiled while hooked: not kept
    assert len(kernel.kernel.launches) == 5 and not kernel.kernel.compiled.runs and len(kernel._compiled) == 1


def test_a_constexpr_passed_positionally_or_a_grid_function_always_launches_through_triton(kernel):
    """The key holds a positional integer by class; Triton holds a constexpr by value (BLOCK=16 and 32 compile
    apart): such launches never use the cache, nor does a grid Triton computes from the arguments."""
    x = torch.zeros(64)
    for block in (16, 32, 16):
        kernel[(1,)](x, 32, 0.5, block)
    for _ in range(2):
        kernel[lambda args: (1,)](x, 32, 0.5, BLOCK=16)
    assert len(kernel.kernel.launches) == 5 and not kernel._compiled and not kernel.kernel.compiled.runs


@pytest.mark.parametrize("knob", ["debug", "instrumentation_mode"])
def test_launches_triton_instruments_neither_use_nor_fill_the_cache(kernel, monkeypatch, knob):
    """Triton keys its kernels on debug mode and the instrumentation mode: a kernel compiled under either is
    never kept, and one kept before is not launched while either is on."""
    x = torch.zeros(64)
    kernel[(1,)](x, 32, 0.5, BLOCK=16)  # kept
    where = triton.knobs.runtime if knob == "debug" else triton.knobs.compilation
    before = getattr(where, knob)
    monkeypatch.setattr(where, knob, True if knob == "debug" else "fpsan")
    kernel[(1,)](x, 32, 0.5, BLOCK=16)
    kernel[(1,)](x, 32, 0.5, BLOCK=32)
    assert len(kernel.kernel.launches) == 3 and len(kernel._compiled) == 1 and not kernel.kernel.compiled.runs
    monkeypatch.setattr(where, knob, before)
    kernel[(1,)](x, 32, 0.5, BLOCK=16)
    assert len(kernel.kernel.compiled.runs) == 1


INTERPRETED = bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1 where there is no GPU (conftest.py)


@pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter is off (a GPU)")
def test_the_interpreter_keeps_tritons_own_function():
    interpreted = triton.jit(_kernel_fn)
    assert cached_launch(interpreted) is interpreted


@cached_launch
@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="launches a compiled kernel on a GPU")
def test_on_a_gpu_a_repeat_launch_skips_the_binder_computes_the_same_and_refuses_host_memory():
    assert launch._on(), f"the cached launch is off on this GPU (Triton {triton.__version__}): see KNOWN_TRITON"
    x, y = torch.randn(2, 1024, device="cuda")
    for n in (1024, 1000, 1024, 1000):  # two specialisations (n divisible by 16 or not), each launched twice
        out = torch.zeros(1024, device="cuda")
        _add_kernel[(cdiv(n, 128),)](x, y, out, n, BLOCK=128)
        assert torch.equal(out[:n], x[:n] + y[:n]) and not out[n:].any()
    assert _add_kernel.through_triton == 2 and len(_add_kernel._compiled) == 2
    host = torch.zeros(1024)  # the same specialisation as a cached launch, in host memory: the launcher refuses it
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):
        _add_kernel[(8,)](x, y, host, 1024, BLOCK=128)


def _launched(tree: ast.Module) -> set[str]:
    """Names launched as ``name[grid](...)`` in a module."""
    return {
        node.func.value.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name)
    }


@pytest.mark.parametrize("path", LAUNCHERS, ids=lambda p: p.name)
def test_every_launched_kernel_has_the_cached_launch(path: Path):
    tree = ast.parse(path.read_text())
    kernels = {
        f.name: [ast.unparse(d) for d in f.decorator_list]
        for f in tree.body
        if isinstance(f, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in f.decorator_list)
    }
    missing = [name for name in _launched(tree) & set(kernels) if kernels[name][0] != "cached_launch"]
    assert not missing, f"{path.name}: kernels launched without @cached_launch: {missing}"


def test_the_host_helpers_equal_tritons():
    for n in [*range(-3, 4100), 2**31 - 1, 2**31, 2**40 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for x, y in itertools.product(range(300), range(1, 40)):
        assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
