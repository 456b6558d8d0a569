"""What every test run of this repository needs before any test module is imported.

Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before the first
``@triton.jit`` function is made: any test module may import a plugin that defines kernels (the CUDA
plugin's fusions), so the choice is made here, not in the Triton tests' own conftest. The
interpreter is spared one redundant step (:func:`_patch_triton_language_once_per_launch`). Every
process of the run gets one torch thread and keeps its bytecode caches (:func:`_cheap_processes`).

pyproject.toml's ``addopts`` hands pytest-xdist its workers (``-n auto --maxprocesses 4 --dist
loadgroup``). Where xdist is not loaded (``-p no:xdist``, or a venv set up before it was a
requirement) those options are accepted here and mean nothing: the suite runs in this process.
Modules holding a ``slow`` test run first (:func:`pytest_collection_modifyitems`), so the workers
start on the long tests and the short ones fill in behind them.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

#: pytest-xdist's options that pyproject.toml's addopts passes
_XDIST_ADDOPTS = (("-n", "--numprocesses"), ("--maxprocesses",), ("--dist",))


def _patch_triton_language_once_per_launch() -> bool:
    """Make the interpreter patch ``triton.language`` once per kernel launch, not again at every helper call.

    Triton 3.6's interpreter replaces ``triton.language``'s builtins with interpreted ones when a
    kernel is launched, and restores them when it returns; it also redoes the replacement, by
    ``inspect.getmembers`` over four modules, each time the kernel calls a ``@triton.jit`` helper,
    although the launch's replacement is still in place: a third of the time of a prefill-attention
    sample whose loop calls helpers. Here a helper whose modules the running launch already patched
    skips that repeat; the replacement is the same either way (one builder, the same functions).
    Kept for what it saves: ``core/tests/triton`` in one process took 147 CPU s with it, 179 without
    (issue 26; 16 of the 32 s on the bfloat16 prefill samples).
    True once installed; False without Triton's interpreter (nothing is changed).
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or scope_type is None or getattr(patch_lang, "once_per_launch", False):
        return patch_lang is not None and scope_type is not None
    patched: list[set[int]] = []  # the language modules patched in the running launch (empty between launches)

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_lang_once(fn):
        wanted = languages(fn)
        if patched and wanted <= patched[0]:
            return scope_type()  # a helper inside a launch: already patched, nothing to restore
        scope = patch_lang(fn)
        if patched:  # a helper naming another module (``tl.core``): patched now, and never restored by Triton
            patched[0] |= wanted
        else:  # a launch: its scope's restore() ends it
            patched.append(wanted)
            restore = scope.restore

            def restore_and_end() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_end
        return scope

    patch_lang_once.once_per_launch = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang_once
    return True


def _cheap_processes() -> None:
    """One torch thread a process, and Python's bytecode caches kept, here and in every process the run starts.

    pytest-xdist runs one worker a core: a second torch thread in each only contends for a core that
    is already busy, and OpenMP threads spinning on a loaded machine cost up to twice the CPU seconds
    of one thread (a CPU certification: 41 CPU s on one thread, 94 on two under load). A developer's
    own ``OMP_NUM_THREADS`` is kept. The run starts about a hundred Python processes
    (certifications, ranks, venvs, the command line): with ``PYTHONDONTWRITEBYTECODE`` set (some
    machines set it), each would compile every module it imports that a cache does not already hold,
    and pytest's assertion rewrites of hypothesis and the suite, again; dropped here, the first
    process writes the caches (``__pycache__/``, which git ignores) and the others read them.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # before the xdist workers and subprocesses start: they read it
        torch.set_num_threads(1)  # this process's torch has started its threads already
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        sys.dont_write_bytecode = False


_cheap_processes()
if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_language_once_per_launch()


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    if pluginmanager.has_plugin("xdist"):
        return
    group = parser.getgroup("xdist-absent", "pytest-xdist not loaded: its addopts are ignored, tests run here")
    for flags in _XDIST_ADDOPTS:  # _addoption: lowercase short flags (-n) are reserved to plugins
        group._addoption(*flags, action="store", dest=f"absent_xdist_{flags[-1].lstrip('-')}", help="ignored")


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, whose group suffix this one makes good
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules holding a ``slow`` test first, each module's tests in their order (so its fixtures are set up once).

    pytest-xdist hands out tests in this order: a long test left to the end would run alone on one
    worker while the others sit idle. On a worker of a ``--dist loadgroup`` run, each test of an
    ``xdist_group`` also gets its group in its id (:func:`_name_xdist_groups`).
    """
    slow_modules = {getattr(item, "module", None) for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: getattr(item, "module", None) not in slow_modules)
    if getattr(config.option, "loadgroup", False):  # set on pytest-xdist's workers only
        _name_xdist_groups(items)


def _name_xdist_groups(items: list[pytest.Item]) -> None:
    """Append ``@group`` to the id of every test marked ``xdist_group``, as pytest-xdist means to.

    ``--dist loadgroup`` sends the tests whose ids end in one ``@group`` to one worker. pytest-xdist
    3.8 writes the suffix to ``item._nodeid``, which pytest 9.2 no longer reads (an item's id is
    ``item._id``): every group was split across the workers, and a worker needing a shared run
    (a certification, the wheels) sat idle while another made it (about 150 s of a 670 s run).
    The ids the workers report are the ones the scheduler groups by, so the suffix goes there.
    """
    for item in items:
        groups = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        suffix = f"@{'_'.join(sorted(groups))}"
        if not groups or item.nodeid.endswith(suffix):  # before pytest 9.2, pytest-xdist's own suffix is there
            continue
        from _pytest.nodeid import NodeId  # pytest >= 9.2, where the id is ``item._id``

        item._id = NodeId.parse(item.nodeid + suffix)
