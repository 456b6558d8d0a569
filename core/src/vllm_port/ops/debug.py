"""Providers that misbehave at run time: naming them, checking them, and taking them out of service.

Three tools, from free to thorough:

* **Blame** (always, no cost on the hot path): a bound op is the provider's own function, so an
  exception it raises carries the provider's frame. :func:`blame` (``with blame(kernels): ...``, once
  around a whole engine step) finds that frame and re-raises the failure as a
  :class:`~vllm_port.errors.ProviderError` naming the op, the provider, its plugin and how to run
  without it. An :class:`~vllm_port.errors.OpInputError` stays what it is: the caller's inputs. So
  does a failure on inputs the op's own input check refuses (run on the arguments in the
  provider's frame, after the fact): the provider is named only on evidence against it.
* **Smoke check at bind** (``runtime.bind(dtype, verify=True)``; ``vllm-port doctor`` always):
  :func:`smoke_check` runs each candidate on its op's small samples against the float64
  reference, and one that raises, returns the wrong shape, dtype or device, or wrong values is
  skipped for the next candidate, with the reason in ``BoundOps.skipped``.
* **Debug mode** (``VLLM_PORT_CHECK=<rate>``): every bound op becomes a :class:`CheckedOp`. Each
  call's output shape, dtype and device are checked against the op's fake (cached per input
  shapes: about a microsecond); the first call of each provider and then a share ``rate`` of the
  calls, drawn from a generator seeded by ``VLLM_PORT_CHECK_SEED`` (so the same run checks the same
  calls), are compared with the float64 reference within the op's tolerance. In-place arguments
  are copied before such a call. On the first fault the inputs are written to a reproducer
  (safetensors + JSON, under ``VLLM_PORT_CHECK_DIR``, replayed by ``vllm-port check-repro FILE``),
  the provider is **quarantined** for the rest of the process (this call and every later one go
  to the next candidate; later binds skip it too) and a warning names it. Strict mode refuses
  the quarantine and raises instead. Quarantine takes evidence: a provider that raises is
  quarantined only when the reference, on the same inputs, does not raise too (when it does, the
  inputs are at fault: an :class:`~vllm_port.errors.OpInputError` says so and nobody is quarantined).
* **Scrutiny** (:func:`scrutinize`, debug mode only): re-run a step, typically one whose logits
  were not finite, with every call of every checked op compared with its reference, and name the
  first op at fault, or the first whose output was not finite where the reference agrees.

What debug mode does not see: calls inside a captured device graph (replays run no Python) or a
compiled graph (``bind(traceable=True)`` is left unchecked); run such engines eagerly to check them.

This module is the one door to all of it; each concern lives in a module of its own:

==========================  ========================================================================
``_blame.py``               which provider raised: :func:`blame`, :func:`provider_fault`
``_registry.py``            the quarantine table (:func:`quarantine`, :func:`quarantined`), beside binding
``_smoke.py``               :func:`smoke_check` and the samples it runs
``_check_config.py``        debug mode's settings: :class:`CheckConfig`, :func:`check_config`
``_checked.py``             :class:`CheckedOp`, and :func:`checked_ops`, which ``Runtime.bind`` calls
``_compare.py``             one call against the fake's metadata and the reference's values
``_scrutiny.py``            :func:`scrutinize`: a step re-run with every call compared
``_repro.py``               reproducer files: :func:`write_repro`, :func:`load_repro`
==========================  ========================================================================

``vllm-port check-repro FILE``, the command that replays a reproducer, is :mod:`vllm_port.replay_command`.
"""

from __future__ import annotations

from ._blame import blame, provider_fault, provider_in_traceback, way_around
from ._check_config import (
    CHECK_DIR_ENV,
    CHECK_ENV,
    CHECK_SEED_ENV,
    DEFAULT_CHECK_RATE,
    CheckConfig,
    check_config,
)
from ._checked import CheckedOp, checked_ops
from ._compare import compare_with_reference, metadata_problem
from ._provider import who
from ._registry import clear_quarantine, quarantine, quarantined
from ._repro import REPRO_FORMAT, load_repro, write_repro
from ._scrutiny import Scrutiny, scrutinize
from ._smoke import SMOKE_SAMPLES, smoke_check, smoke_samples

__all__ = [
    "CHECK_DIR_ENV",
    "CHECK_ENV",
    "CHECK_SEED_ENV",
    "DEFAULT_CHECK_RATE",
    "REPRO_FORMAT",
    "SMOKE_SAMPLES",
    "CheckConfig",
    "CheckedOp",
    "Scrutiny",
    "blame",
    "check_config",
    "checked_ops",
    "clear_quarantine",
    "compare_with_reference",
    "load_repro",
    "metadata_problem",
    "provider_fault",
    "provider_in_traceback",
    "quarantine",
    "quarantined",
    "scrutinize",
    "smoke_check",
    "smoke_samples",
    "way_around",
    "who",
    "write_repro",
]
