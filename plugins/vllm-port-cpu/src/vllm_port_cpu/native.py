"""Native paged attention for the CPU plugin: a small C kernel built at first use and called through ctypes.

The torch providers (:mod:`.attention`) gather every sequence's K/V blocks into a copy and run
torch's attention per sequence batch; at decode (one query row, a few hundred keys) the copy and the
per-(sequence, head) overhead of that kernel dominate. ``csrc/paged_attention.c`` reads the paged
caches in place instead: one OpenMP work item per (sequence, KV head[, query tile]) handles every
query head of the group, so each K/V row is read once, with an online softmax in float32.

Build: the system C compiler (``cc`` or ``gcc`` on ``PATH``) with ``-O3 -march=native -fopenmp``,
into ``$VLLM_PORT_CACHE_DIR`` (default ``~/.cache/vllm-port``) under a name keyed by the source,
the compiler and the CPU's flags; written to a temporary file and renamed, so processes building at
once never load a partial library. ``VLLM_PORT_CPU_NATIVE=0`` turns the kernels off. When they are
off or the build fails, the providers' support predicate declines and the torch providers serve the
ops; :data:`status` says why (the probe's ``"native_attention"`` capability, shown by ``doctor``).

Per call, arguments the kernel does not cover (a tensor whose last dimension is not contiguous,
float64, a device other than the CPU) go to the torch provider.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform as _host
import shutil
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import torch

from vllm_port.errors import OpInputError
from vllm_port.faults import read_switch
from vllm_port.ops import BindContext, provider
from vllm_port.ops.attention import check_paged_attention, check_prefill_attention

from . import attention

__all__ = ["ENV_SWITCH", "available", "check", "library", "paged_attention", "prefill_attention", "status"]

#: ``VLLM_PORT_CPU_NATIVE=0`` keeps the native kernels off (the torch providers serve the ops).
ENV_SWITCH = "VLLM_PORT_CPU_NATIVE"
CACHE_ENV = "VLLM_PORT_CACHE_DIR"
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
COMPILERS = ("cc", "gcc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
#: Above the torch providers (10).
NATIVE_PRIORITY = 15
BUILD_TIMEOUT_S = 120

#: Why the native kernels are or are not in use; set when the library is first asked for.
status = "not built yet (builds at first use)"

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ERRORS = {
    1: "this build of the kernel has no float16 support",
    2: "a seq_lens entry is negative or longer than its block_tables row holds (columns * block_size)",
    3: "a block_tables entry a sequence uses is outside [0, num_blocks) of the caches",
    4: "cu_seqlens_q must start at 0, never decrease, and end at most at the query's token count",
    5: "out of memory for the kernel's scratch buffers",
}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False
_float16 = False  # the loaded build converts float16


def _disabled() -> bool:
    return not read_switch(ENV_SWITCH, default=True)  # a value that is no switch is an error, not "on"


def _compiler() -> str | None:
    return next((found for name in COMPILERS if (found := shutil.which(name))), None)


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "vllm-port"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@lru_cache(maxsize=4)
def _library_path(compiler: str) -> Path:
    """Where the library built by ``compiler`` for this source and CPU lives: the name is a hash of all three."""
    try:
        # the compiler found on PATH, with fixed arguments
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), compiler.encode(), version.encode(), " ".join(FLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    key.update((_cpu_flags() + _host.machine()).encode())
    return _cache_dir() / f"cpu-paged-attention-{key.hexdigest()[:20]}.so"


def _failure_log(target: Path) -> Path:
    """Where a failed build of ``target`` leaves its error, for :func:`check` (the probe) to report."""
    return target.with_suffix(".failed.txt")


def _build(compiler: str, target: Path) -> None:
    """Compile the source into ``target`` through a temporary file in the same directory, then rename it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)  # noqa: S603 - as above
        if done.returncode != 0:
            error = done.stderr.strip()[-800:] or "(no message)"
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {error} (command: {' '.join(cmd)})")
        os.replace(tmp, target)  # atomic: a concurrent build of the same source renames an equal file
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        with contextlib.suppress(OSError):
            _failure_log(target).write_text(str(exc), encoding="utf-8")
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    with contextlib.suppress(OSError):
        _failure_log(target).unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    cache = [p, p, p, p, i64, i64, i64, i64, i64, p, i64, i64, i32]  # caches, strides, sizes, tables
    lib.vp_paged_attention.argtypes = [p, p, i64, i64, *cache, p, i32, i64, i32, f32, i64, f32, i32]
    lib.vp_prefill_attention.argtypes = [p, p, i64, i64, i64, *cache, p, i32, p, i32, i64, i32, f32, i64, f32, i32]
    lib.vp_paged_attention.restype = lib.vp_prefill_attention.restype = i32
    lib.vp_has_float16.restype = i32


def check() -> tuple[bool, str]:
    """Whether the native kernels may be used, and why not, without building anything (the probe's view)."""
    if _disabled():
        return False, f"off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})"
    if _loaded:
        return _library is not None, status
    compiler = _compiler()
    if compiler is None:
        return False, f"off: no C compiler ({' or '.join(COMPILERS)}) on PATH; the torch kernels serve attention"
    try:  # the probe calls this: it must answer, never raise
        path = _library_path(compiler)
        if path.exists():
            return True, f"built ({path})"
        failed = _failure_log(path)
        if failed.exists():
            error = failed.read_text(encoding="utf-8", errors="replace").strip()
            return False, f"off: the last build failed (retried at first use; {failed}): {error[:300]}"
    except OSError as exc:
        return False, f"off: {exc}"
    return True, f"not built yet (builds with {compiler} at first use)"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built first if needed; ``None`` when off or unbuildable (see :data:`status`)."""
    global _library, _loaded, _float16, status
    if _loaded or _disabled():
        return None if _disabled() else _library
    with _lock:
        if _loaded:
            return _library
        compiler = _compiler()
        if compiler is None:
            status = check()[1]
        else:
            try:
                path = _library_path(compiler)
                if not path.exists():
                    _build(compiler, path)
                lib = ctypes.CDLL(str(path))
                _declare(lib)
                _float16 = bool(lib.vp_has_float16())
                _library, status = lib, f"on ({path})"
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                status = f"off: the build or load failed; the torch kernels serve attention: {exc}"
        _loaded = True
    return _library


def available(ctx: BindContext | None = None) -> bool:
    """The support predicate: the kernels are on, built and loaded, and cover ``ctx``'s dtype."""
    lib = library()
    if lib is None:
        return False
    return ctx is None or ctx.dtype != torch.float16 or _float16


def _covered(lib: ctypes.CDLL | None, query: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether the kernel handles these tensors: CPU, a dtype it was built for, last dimension contiguous."""
    if lib is None or not query.is_cpu or query.dtype not in _DTYPE_CODES:
        return False
    if query.dtype == torch.float16 and not _float16:
        return False
    for t in (query, *tensors):  # a plain loop: this runs on every call
        if not t.is_cpu or (t.stride(-1) != 1 and t.shape[-1] > 1):
            return False
    return True


def _cache_args(key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, num_heads: int) -> list:
    """The kernels' cache and block-table arguments, in their C order (``num_heads``: the query's)."""
    num_blocks, block_size, kv_heads, _ = key_cache.shape
    k_strides = (ctypes.c_int64 * 3)(*key_cache.stride()[:3])
    v_strides = (ctypes.c_int64 * 3)(*value_cache.stride()[:3])
    return [
        key_cache.data_ptr(),
        k_strides,
        value_cache.data_ptr(),
        v_strides,
        num_blocks,
        block_size,
        kv_heads,
        key_cache.shape[3],
        num_heads,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        int(block_tables.dtype == torch.int64),
    ]


def _raise(op: str, code: int) -> None:
    if code:
        raise OpInputError(f"{op} (provider cpu_native_{op}): {_ERRORS.get(code, f'kernel error {code}')}")


@provider("paged_attention", name="cpu_native_paged_attention", priority=NATIVE_PRIORITY, supports=available)
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap)
    lib = _library if _loaded else library()
    if not _covered(lib, query, key_cache, value_cache, block_tables, seq_lens):
        return attention.paged_attention.fn(
            query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, soft_cap
        )
    num_seqs, num_heads, head_size = query.shape
    out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype)
    if num_seqs == 0:
        return out
    cache = _cache_args(key_cache, value_cache, block_tables, num_heads)
    code = lib.vp_paged_attention(  # type: ignore[union-attr]
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        *cache,
        seq_lens.data_ptr(),
        int(seq_lens.dtype == torch.int64),
        num_seqs,
        _DTYPE_CODES[query.dtype],
        float(scale),
        sliding_window,
        float(soft_cap),
        torch.get_num_threads(),
    )
    _raise("paged_attention", code)
    return out


@provider("prefill_attention", name="cpu_native_prefill_attention", priority=NATIVE_PRIORITY, supports=available)
def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:
    args = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_query_len, scale)
    check_prefill_attention(*args, sliding_window, soft_cap)
    lib = _library if _loaded else library()
    if not _covered(lib, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens):
        return attention.prefill_attention.fn(*args, sliding_window, soft_cap)
    tokens, num_heads, head_size = query.shape
    # rows past cu_seqlens_q[-1] belong to no sequence: zero, as the reference returns them
    out = torch.zeros((tokens, num_heads, head_size), dtype=query.dtype)
    num_seqs = seq_lens.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    cache = _cache_args(key_cache, value_cache, block_tables, num_heads)
    code = lib.vp_prefill_attention(  # type: ignore[union-attr]
        out.data_ptr(),
        query.data_ptr(),
        query.stride(0),
        query.stride(1),
        tokens,
        *cache,
        cu_seqlens_q.data_ptr(),
        int(cu_seqlens_q.dtype == torch.int64),
        seq_lens.data_ptr(),
        int(seq_lens.dtype == torch.int64),
        num_seqs,
        _DTYPE_CODES[query.dtype],
        float(scale),
        sliding_window,
        float(soft_cap),
        torch.get_num_threads(),
    )
    _raise("prefill_attention", code)
    return out
