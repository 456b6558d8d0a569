"""The native kernel library is loaded only from a directory this user alone can write, and only with the hash it was built with.

A library is planted where the plugin computes its path: a real shared object whose constructor
writes a marker file when ``dlopen`` runs it. The marker must never appear, whether the cache
directory is world-writable (refused: the library is built in a private fallback, or strict mode
refuses) or private with a recorded hash that the planted file does not match (rebuilt, not loaded).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_port.doctor import diagnose
from vllm_port.errors import StrictModeError
from vllm_port_cpu import native

needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler (cc or gcc) on PATH")

PLANTED_SOURCE = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("the planted library ran", f); fclose(f); }
}
"""


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The module as in a new process; HOME in tmp_path, so the default cache directory is a private one there."""
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "status", "not built yet")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.delenv("VLLM_PORT_STRICT", raising=False)
    native._library_name.cache_clear()
    yield tmp_path
    native._library_name.cache_clear()


def _plant(where: Path, tmp: Path) -> tuple[Path, Path]:
    """A real shared object at ``where`` whose constructor writes a marker; the marker's path and the object."""
    marker = tmp / "planted-library-ran"
    source = tmp / "planted.c"
    source.write_text(PLANTED_SOURCE % marker)
    where.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([native._compiler(), "-shared", "-fPIC", "-o", str(where), str(source)], check=True)
    return marker, where


def _shared_cache(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shared = tmp / "shared-cache"
    (shared / native.PRIVATE_DIR).mkdir(parents=True)
    for d in (shared, shared / native.PRIVATE_DIR):
        d.chmod(0o777)  # what a shared /tmp folder or a group cache might be
    monkeypatch.setenv(native.CACHE_ENV, str(shared))
    return shared


def _plant_with_its_hash(shared: Path, tmp: Path) -> Path:
    """A planted library at the computed path with a hash file that matches it: only the directory check stops it."""
    name = native._library_name(native._compiler())
    marker, planted = _plant(shared / native.PRIVATE_DIR / name, tmp)
    shutil.copy(planted, shared / name)  # and where a cache without cpu-native/ would have kept it
    digest = hashlib.sha256(planted.read_bytes()).hexdigest()
    (shared / native.PRIVATE_DIR / (name + native.HASH_SUFFIX)).write_text(digest + "\n")
    return marker


@pytest.mark.slow
@needs_cc
def test_a_library_planted_in_a_world_writable_cache_directory_is_never_loaded(fresh, monkeypatch, caplog):
    shared = _shared_cache(fresh, monkeypatch)
    marker = _plant_with_its_hash(shared, fresh)
    ok, why = native.check()  # the probe: names the fallback, loads nothing
    assert ok and "cache directory refused" in why and "can be written by others (mode 777)" in why
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native.available()  # the genuine kernels, built in the private fallback
    private = fresh / "home" / ".cache" / "vllm-port" / native.PRIVATE_DIR
    loaded = private / native._library_name(native._compiler())
    assert native.status.startswith(f"on ({loaded}); ") and f"{shared} can be written by others" in native.status
    assert private.stat().st_mode & 0o777 == 0o700
    assert any("cache directory refused" in r.getMessage() for r in caplog.records)  # one warning says which
    assert not marker.exists(), "the planted library's constructor ran"


@pytest.mark.slow
@needs_cc
def test_with_the_default_cache_directory_world_writable_a_new_temporary_directory_serves(fresh, monkeypatch):
    monkeypatch.delenv(native.CACHE_ENV, raising=False)
    shared = fresh / "home" / ".cache" / "vllm-port"
    (shared / native.PRIVATE_DIR).mkdir(parents=True)
    for d in (shared, shared / native.PRIVATE_DIR):
        d.chmod(0o777)
    marker = _plant_with_its_hash(shared, fresh)
    assert native.available()
    loaded = Path(native.status.removeprefix("on (").split(")")[0])
    assert loaded.parent.name.startswith("vllm-port-cpu-native-") and loaded.parent.stat().st_mode & 0o777 == 0o700
    assert f"{shared} can be written by others" in native.status
    assert not marker.exists()


@needs_cc
def test_strict_mode_refuses_a_world_writable_cache_directory(fresh, monkeypatch):
    shared = _shared_cache(fresh, monkeypatch)
    marker = _plant_with_its_hash(shared, fresh)
    monkeypatch.setenv("VLLM_PORT_STRICT", "1")
    ok, why = native.check()
    assert not ok and "strict mode" in why and f"{shared} can be written by others" in why
    with pytest.raises(StrictModeError, match=f"cache directory refused, {shared} can be written by others"):
        native.library()
    assert not marker.exists()


@needs_cc
def test_a_cache_directory_of_another_user_is_refused(fresh, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(fresh / "theirs"))
    (fresh / "theirs").mkdir()
    real_stat = Path.stat

    def owned_by_someone_else(self: Path, *args, **kwargs):
        result = real_stat(self, *args, **kwargs)
        if self == fresh / "theirs":
            values = list(result)
            values[4] = result.st_uid + 1  # st_uid
            return type(result)(values)
        return result

    monkeypatch.setattr(Path, "stat", owned_by_someone_else)
    ok, why = native.check()
    assert ok and f"{fresh / 'theirs'} is owned by uid" in why and "not by this user" in why


@pytest.mark.slow
@needs_cc
@pytest.mark.parametrize("record", ["a wrong hash", "no hash file"])
def test_a_library_in_the_private_directory_that_differs_from_its_hash_is_rebuilt_not_loaded(
    fresh, monkeypatch, record
):
    cache = fresh / "cache"
    monkeypatch.setenv(native.CACHE_ENV, str(cache))
    path = cache / native.PRIVATE_DIR / native._library_name(native._compiler())
    marker, _ = _plant(path, fresh)
    (cache / native.PRIVATE_DIR).chmod(0o700)
    if record == "a wrong hash":
        (path.parent / (path.name + native.HASH_SUFFIX)).write_text(hashlib.sha256(b"what was built").hexdigest())
    ok, why = native.check()
    assert ok and why == f"{path} does not match its recorded SHA-256: rebuilt at first use, never loaded"
    assert native.available() and native.status == f"on ({path})"
    recorded = (path.parent / (path.name + native.HASH_SUFFIX)).read_text().strip()
    assert recorded == hashlib.sha256(path.read_bytes()).hexdigest()  # the rebuilt library, as recorded
    assert not marker.exists(), "the planted library's constructor ran"


@pytest.mark.slow
@needs_cc
def test_doctor_names_the_library_it_loaded(fresh, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(fresh / "cache"))
    report = diagnose(plugins="cpu")
    cpu = next(p for p in report["plugins"] if p["name"] == "cpu")
    path = fresh / "cache" / native.PRIVATE_DIR / native._library_name(native._compiler())
    assert cpu["capabilities"]["native_attention"] == f"on ({path})"
    assert report["ops"]["paged_attention"]["provider"] == "cpu_native_paged_attention"
