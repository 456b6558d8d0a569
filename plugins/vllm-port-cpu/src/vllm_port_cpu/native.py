"""Native kernels for the CPU plugin: a small C library built at first use and called through ctypes.

It holds paged attention and the cache write (here) and fused element-wise kernels (``csrc/elementwise.c``,
whose providers are in :mod:`.native_elementwise`), built from both sources into one library.

The torch providers (:mod:`.attention`) gather every sequence's K/V blocks into a copy and run
torch's attention per sequence batch; at decode (one query row, a few hundred keys) the copy and the
per-(sequence, head) overhead of that kernel dominate. ``csrc/paged_attention.c`` reads the paged
caches in place instead: one OpenMP work item per (sequence, KV head[, query tile]) handles every
query head of the group, so each K/V row is read once, with an online softmax in float32.

Build: the system C compiler (``cc`` or ``gcc`` on ``PATH``) with ``-O3 -march=native -fopenmp``,
into ``cpu-native/`` of ``$VLLM_PORT_CACHE_DIR`` (default ``~/.cache/vllm-port``) under a name keyed
by the sources, the compiler and the CPU's flags; written to a temporary file and renamed, so
processes building at once never load a partial library. ``VLLM_PORT_CPU_NATIVE=0`` turns the
kernels off. When they are off or the build fails, the providers' support predicate declines and the
torch providers serve the ops; :data:`status` says why, and which file is loaded (the probe's
``"native_attention"`` capability, shown by ``doctor``).

Loading a shared library runs its code, so only this user may have written the one loaded: the
name is a hash anyone can compute. ``cpu-native/`` is made with mode 0700 and must be owned by this
user; a cache directory that another user owns or that group or others can write is refused with a
warning, and the library is built in a private fallback instead (``~/.cache/vllm-port``, else a new
temporary directory); strict mode (``VLLM_PORT_STRICT=1``) refuses the fallback. Each build records
the library's SHA-256 in ``<library>.sha256`` beside it (written to a temporary file and renamed); a
library is loaded only when its content matches that hash, hashed from the same open file that is
then loaded, and is rebuilt, never loaded, when it does not.

Per call, arguments the kernel does not cover (a tensor whose last dimension is not contiguous,
float64, a device other than the CPU) go to the torch provider.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import math
import os
import platform as _host
import shutil
import stat
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import torch

from vllm_port.errors import OpInputError, StrictModeError
from vllm_port.faults import fall_back, read_switch
from vllm_port.ops import BindContext, provider
from vllm_port.ops.attention import check_paged_attention, check_prefill_attention, check_reshape_and_cache

from . import attention, host_malloc

__all__ = [
    "ENV_SWITCH",
    "available",
    "check",
    "library",
    "paged_attention",
    "prefill_attention",
    "reshape_and_cache",
    "status",
]

#: ``VLLM_PORT_CPU_NATIVE=0`` keeps the native kernels off (the torch providers serve the ops).
ENV_SWITCH = "VLLM_PORT_CPU_NATIVE"
CACHE_ENV = "VLLM_PORT_CACHE_DIR"
#: The private directory (mode 0700) under the cache directory that holds the library and its hash.
PRIVATE_DIR = "cpu-native"
HASH_SUFFIX = ".sha256"
SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("paged_attention.c", "elementwise.c"))
#: What the sources include: the dtype and error codes and float16 support they share (in the build's hash too).
HEADERS = (Path(__file__).with_name("csrc") / "native.h",)
COMPILERS = ("cc", "gcc")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
#: Above the torch providers (10).
NATIVE_PRIORITY = 15
BUILD_TIMEOUT_S = 120

#: Why the native kernels are or are not in use; set when the library is first asked for.
status = "not built yet (builds at first use)"

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: csrc/native.h's code for a rotary position outside the table (the provider names the position itself)
ERR_POSITION = 6
#: csrc/native.h's code for a slot outside the caches (the provider names the token itself)
ERR_SLOT = 8
#: csrc/native.h's error codes, as messages
_ERRORS = {
    1: "this build of the kernel has no float16 support",
    2: "a seq_lens entry is negative or longer than its block_tables row holds (columns * block_size)",
    3: "a block_tables entry a sequence uses is outside [0, num_blocks) of the caches",
    4: "cu_seqlens_q must start at 0, never decrease, and end at most at the query's token count",
    5: "out of memory for the kernel's scratch buffers",
    ERR_POSITION: "a positions entry is outside [0, max_position) of cos_sin_cache",
    7: "cos_sin_cache's rotary_dim must be even and at most 2048",
    ERR_SLOT: "a slot_mapping entry is outside [-1, num_blocks * block_size)",
}
log = logging.getLogger(__name__)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_loaded = False
_float16 = False  # the loaded build converts float16


def _disabled() -> bool:
    return not read_switch(ENV_SWITCH, default=True)  # a value that is no switch is an error, not "on"


def _compiler() -> str | None:
    return next((found for name in COMPILERS if (found := shutil.which(name))), None)


def _default_cache_root() -> Path:
    return Path.home() / ".cache" / "vllm-port"


def _cache_root() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else _default_cache_root()


def _unsafe(directory: Path) -> str | None:
    """Why another user could change what ``directory`` holds (``None``: only this user can, or it is absent)."""
    try:
        info = directory.stat()
    except FileNotFoundError:
        return None  # made by this process, with its mode
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if info.st_uid != os.geteuid():
        return f"{directory} is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        who = "others" if info.st_mode & 0o002 else "its group"
        return f"{directory} can be written by {who} (mode {info.st_mode & 0o777:o})"
    return None


def _private_dir(root: Path) -> Path:
    """``root``'s ``cpu-native/``, made with mode 0700 if absent, or tightened to it (it is this user's).

    :raises PermissionError: when ``root`` or the directory is not this user's alone (:func:`_unsafe`).
    """
    directory = root / PRIVATE_DIR
    for path in (root, directory):
        why = _unsafe(path)
        if why:
            raise PermissionError(why)
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.mkdir(exist_ok=True, mode=0o700)
    why = _unsafe(directory)  # made by another user between the check and mkdir
    if why:
        raise PermissionError(why)
    if directory.stat().st_mode & 0o077:  # this user's, readable by others: nobody else wrote it
        directory.chmod(0o700)
    return directory


def _cache_dir(*, create: bool = True) -> tuple[Path, str]:
    """The private directory the library is built in and loaded from, and a note on why it is not the configured one.

    A cache directory others could write, or another user owns, is replaced by the default one when
    that is this user's alone, else by a new temporary directory (removed at exit); the note says
    which and why, for the warning. Strict mode refuses the fallback instead.
    ``create=False`` (the probe) names the directory without making it.

    :raises StrictModeError: in strict mode, for a cache directory that is not this user's alone.
    """
    root = _cache_root()
    why = _unsafe(root) or _unsafe(root / PRIVATE_DIR)
    if why is None:
        return (_private_dir(root) if create else root / PRIVATE_DIR), ""
    default = _default_cache_root()
    usable = root != default and not (_unsafe(default) or _unsafe(default / PRIVATE_DIR))
    instead = default / PRIVATE_DIR if usable else Path(tempfile.gettempdir()) / "vllm-port-cpu-native-*"
    what = f"the CPU plugin's native kernels: cache directory refused, {why}; the library is built in {instead} instead"
    fall_back(what, f"give {CACHE_ENV} a directory only this user can write (mkdir -m 700), or set {ENV_SWITCH}=0")
    if not create:
        return instead, what
    if usable:
        directory = _private_dir(default)
    else:
        directory = Path(tempfile.mkdtemp(prefix="vllm-port-cpu-native-"))  # mode 0700, this process's own
        atexit.register(shutil.rmtree, directory, ignore_errors=True)  # a loaded library may be unlinked
    return directory, what.replace(str(instead), str(directory))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


@lru_cache(maxsize=4)
def _library_name(compiler: str) -> str:
    """The file name of the library ``compiler`` builds for these sources and CPU: a hash of them all."""
    try:
        # the compiler found on PATH, with fixed arguments
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout  # noqa: S603
    except (OSError, subprocess.SubprocessError):
        version = ""
    key = hashlib.sha256()
    sources = [source.read_bytes() for source in (*SOURCES, *HEADERS)]
    for part in (*sources, compiler.encode(), version.encode(), " ".join(FLAGS).encode()):
        key.update(part)
        key.update(b"\0")
    key.update((_cpu_flags() + _host.machine()).encode())
    return f"cpu-native-{key.hexdigest()[:20]}.so"


def _failure_log(target: Path) -> Path:
    """Where a failed build of ``target`` leaves its error, for :func:`check` (the probe) to report."""
    return target.with_suffix(".failed.txt")


def _hash_file(path: Path) -> Path:
    """Where the SHA-256 recorded when ``path`` was built is kept."""
    return path.with_name(path.name + HASH_SUFFIX)


def _write_atomically(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open_verified(path: Path) -> tuple[int, str] | None:
    """An open descriptor of ``path`` and its hash when its content matches the recorded hash, else ``None``.

    The hash is read from the descriptor that is then loaded: a file swapped in after the check is
    never the one loaded. A link, a file another user owns, or a missing or unreadable record is no match.
    """
    try:
        recorded = _hash_file(path).read_text(encoding="ascii").strip()
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (OSError, UnicodeDecodeError):
        return None
    info = os.fstat(fd)
    digest = hashlib.sha256()
    with open(fd, "rb", closefd=False) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and digest.hexdigest() == recorded:
        return fd, recorded
    os.close(fd)
    return None


def _build(compiler: str, target: Path) -> None:
    """Compile the sources into ``target`` through a temporary file in the same directory, record its hash, rename it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)  # noqa: S603 - as above
        if done.returncode != 0:
            error = done.stderr.strip()[-800:] or "(no message)"
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {error} (command: {' '.join(cmd)})")
        _write_atomically(_hash_file(target), hashlib.sha256(Path(tmp).read_bytes()).hexdigest() + "\n")
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


def _load(path: Path, fd: int) -> ctypes.CDLL:
    """Load the library open as ``fd`` (through ``/proc/self/fd`` where there is one, else by ``path``)."""
    try:
        by_fd = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path))
    finally:
        os.close(fd)


def _verified_library(compiler: str) -> tuple[ctypes.CDLL, Path, str]:
    """The library loaded from the private cache directory, (re)built unless its content matches its recorded
    hash; its path, and the note on a refused cache directory (empty when none was)."""
    directory, note = _cache_dir()
    path = directory / _library_name(compiler)
    opened = _open_verified(path)
    if opened is None:  # absent, or not what was built: never loaded
        if path.exists():
            log.warning("vllm-port-cpu: %s does not match its recorded SHA-256; rebuilding it", path)
        _build(compiler, path)
        opened = _open_verified(path)
        if opened is None:
            raise OSError(f"{path} changed between its build and its load; it is not loaded")
    return _load(path, opened[0]), path, note


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    cache = [p, p, p, p, i64, i64, i64, i64, i64, p, i64, i64, i32]  # caches, strides, sizes, tables
    lib.vp_paged_attention.argtypes = [p, p, i64, i64, *cache, p, i32, i64, i32, f32, i64, f32, i32]
    lib.vp_prefill_attention.argtypes = [p, p, i64, i64, i64, *cache, p, i32, p, i32, i64, i32, f32, i64, f32, i32]
    lib.vp_paged_attention.restype = lib.vp_prefill_attention.restype = i32
    lib.vp_has_float16.restype = i32
    rows = [i64, i64]  # a tensor's outer and inner row strides
    lib.vp_rms_norm.argtypes = [p, p, *rows, p, *rows, p, i64, i64, i64, f32, i32, i32]
    lib.vp_silu_and_mul.argtypes = [p, p, *rows, i64, i64, i64, i32, i32]
    rotated = [p, i64, i64, i64]  # tensor, token and head strides, heads
    lib.vp_rotary_embedding.argtypes = [p, i64, i32, i64, *rotated, *rotated, p, i64, i64, i64, i32, i32, i32, i32]
    lib.vp_rms_norm.restype = lib.vp_silu_and_mul.restype = lib.vp_rotary_embedding.restype = i32
    rows_of = [p, i64, i64]  # key or value: tensor, token and head strides
    lib.vp_reshape_and_cache.argtypes = [*rows_of, *rows_of, p, p, p, p, i64, i64, i64, i64, p, i64, i32, i64, i64, i32]
    lib.vp_reshape_and_cache.restype = i32


def check() -> tuple[bool, str]:
    """Whether the native kernels may be used, and why not, without building anything (the probe's view)."""
    if _disabled():
        return False, f"off ({ENV_SWITCH}={os.environ.get(ENV_SWITCH)})"
    if _loaded:
        return _library is not None, status
    compiler = _compiler()
    if compiler is None:
        return False, f"off: no C compiler ({' or '.join(COMPILERS)}) on PATH; the torch providers serve the ops"
    try:  # the probe calls this: it must answer, never raise
        directory, note = _cache_dir(create=False)
        path = directory / _library_name(compiler)
        note = f"; {note}" if note else ""
        opened = _open_verified(path)
        if opened is not None:
            os.close(opened[0])
            return True, f"built ({path}, SHA-256 {opened[1][:16]} as recorded; loaded at first use){note}"
        failed = _failure_log(path)
        if failed.exists():
            error = failed.read_text(encoding="utf-8", errors="replace").strip()
            return False, f"off: the last build failed (retried at first use; {failed}): {error[:300]}"
        if path.exists():
            return True, f"{path} does not match its recorded SHA-256: rebuilt at first use, never loaded{note}"
    except StrictModeError as exc:
        return False, f"off: {exc}"
    except OSError as exc:
        return False, f"off: {exc}"
    return True, f"not built yet (builds with {compiler} into {path.parent} at first use){note}"


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built first if needed; ``None`` when off or unbuildable (see :data:`status`).

    :raises StrictModeError: in strict mode, when the cache directory is not this user's alone.
    """
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
                lib, path, note = _verified_library(compiler)
                _declare(lib)
                _float16 = bool(lib.vp_has_float16())
                _library, status = lib, f"on ({path})" + (f"; {note}" if note else "")
                if note:
                    log.warning("vllm-port-cpu: %s", note)
            except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
                status = f"off: the build or load failed; the torch providers serve the ops: {exc}"
        _loaded = True
    return _library


def available(ctx: BindContext | None = None) -> bool:
    """The support predicate: the kernels are on, built and loaded, and cover ``ctx``'s dtype.

    Asked whenever the CPU platform's ops are bound, the kernels on or off, so it is also where the process's
    malloc is told to keep freed buffers for the next outputs (:mod:`.host_malloc`).
    """
    host_malloc.keep_freed_buffers()
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


def _float_cap(soft_cap: float) -> bool:
    """Whether the kernels, which take ``soft_cap`` as a C float, see it as given: 0 (no cap), or a positive
    value that stays positive and finite in float32 (a cap under 1.4e-45 would become 0, no cap at all)."""
    return soft_cap == 0 or 0.0 < ctypes.c_float(soft_cap).value < math.inf


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
    if not _covered(lib, query, key_cache, value_cache, block_tables, seq_lens) or not _float_cap(soft_cap):
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
    if not _covered(lib, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens) or not _float_cap(
        soft_cap
    ):
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


@provider("reshape_and_cache", name="cpu_native_reshape_and_cache", priority=NATIVE_PRIORITY, supports=available)
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """One pass that copies each token's rows into its slot, in place (the torch provider: about seven torch calls)."""
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    lib = _library if _loaded else library()
    if not _covered(lib, key, value, key_cache, value_cache, slot_mapping):
        return attention.reshape_and_cache.fn(key, value, key_cache, value_cache, slot_mapping)
    tokens, heads, head_size = key.shape
    if tokens == 0:
        return None
    num_blocks, block_size = key_cache.shape[:2]
    code = lib.vp_reshape_and_cache(  # type: ignore[union-attr]
        key.data_ptr(),
        key.stride(0),
        key.stride(1),
        value.data_ptr(),
        value.stride(0),
        value.stride(1),
        key_cache.data_ptr(),
        (ctypes.c_int64 * 3)(*key_cache.stride()[:3]),
        value_cache.data_ptr(),
        (ctypes.c_int64 * 3)(*value_cache.stride()[:3]),
        num_blocks,
        block_size,
        heads,
        head_size,
        slot_mapping.data_ptr(),
        slot_mapping.stride(0),
        int(slot_mapping.dtype == torch.int64),
        tokens,
        key.element_size(),
        torch.get_num_threads(),
    )
    if code == ERR_SLOT:  # nothing was written: every slot is checked first
        capacity = num_blocks * block_size
        bad = int(((slot_mapping < -1) | (slot_mapping >= capacity)).nonzero()[0, 0])
        raise OpInputError(
            f"reshape_and_cache (provider cpu_native_reshape_and_cache): slot_mapping[{bad}] is "
            f"{int(slot_mapping[bad])}, outside [-1, {capacity}): a slot is -1 (a padded token, not written) or "
            f"block * block_size + offset within the caches' {num_blocks} blocks of {block_size}"
        )
    _raise("reshape_and_cache", code)
    return None
