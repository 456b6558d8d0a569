"""Property-based fuzzing of every contract op on CPU: providers against the float64 reference, and refusals.

For valid inputs (:func:`fuzz_strategies.valid_cases`), every CPU provider (the reference itself,
the CPU plugin's torch providers and, where they build, its native kernels) honours the contract
as :meth:`vllm_port.ops.Op.check` judges it: values within the dtype's tolerance of the float64
reference, no NaN from the poisoned slots and storage around the views, no write outside an
in-place argument's view, padded sequences' rows exactly zero, samplers drawing the reference's
tokens. All of it under validation, so the value checks accept every valid input. The Triton
kernels run the same in Triton's CPU interpreter, on fewer and smaller cases.

For invalid inputs (:func:`fuzz_strategies.invalid_cases`, one broken rule each), every provider,
Triton's included, raises ``OpInputError`` (a ``ValueError``) whose message starts with the op's
name, and writes nothing first: never an ``IndexError`` from deep inside torch, a crash, or an
answer. Structural violations are refused with validation on or off; those only values show, with
validation on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fuzz_budget import COUNTS, fuzz_settings
from fuzz_strategies import Case, invalid_cases, valid_cases
from hypothesis import given
from hypothesis import strategies as st

from vllm_port.errors import OpInputError
from vllm_port.ops import ALL_OPS, Op, Provider
from vllm_port.ops._op import _identical, _storage
from vllm_port.ops.checks import check_embedding, validation
from vllm_port.ops.sampling import check_reference_draws

OPS: dict[str, Op] = {op.name: op for op in ALL_OPS}
NAMES = list(OPS)


def _cpu_providers() -> list[Provider]:
    cpu = pytest.importorskip("vllm_port_cpu.ops")
    from vllm_port_cpu import native

    return [p for p in cpu.PROVIDERS if not p.name.startswith("cpu_native_") or native.available()]


def _triton_providers() -> list[Provider]:
    """The Triton kernels in the CPU interpreter (the repository's conftest.py chooses it when no GPU is here)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    try:
        from vllm_port.kernels.triton import INTERPRETER, providers
    except ImportError:
        return []
    return providers(INTERPRETER)


CPU = _cpu_providers()
TRITON = _triton_providers()
Fn = tuple[str, Callable[..., Any]]


def cpu_fns(op: str) -> list[Fn]:
    return [("reference", OPS[op].reference)] + [(p.name, p.fn) for p in CPU if p.op == op]


def triton_fns(op: str) -> list[Fn]:
    return [(p.name, p.fn) for p in TRITON if p.op == op]


def honours_contract(op: Op, case: Case, fns: list[Fn]) -> None:
    """Every provider matches the float64 reference on ``case`` (and the reference's draws, for ``sample``)."""
    with validation():
        for name, fn in fns:
            problem = op.check(fn, case.args, case.dtype)
            if problem is None and op.name == "sample":
                problem = check_reference_draws(fn, case.args)
            assert problem is None, f"{name} on {case!r}: {problem}"


@pytest.mark.slow
@pytest.mark.parametrize("op", NAMES)
@fuzz_settings(100)
@given(data=st.data())
def test_cpu_providers_match_the_reference_on_valid_inputs(op, data):
    case = data.draw(valid_cases(op), label="case")
    COUNTS["valid (cpu)", op] += 1
    honours_contract(OPS[op], case, cpu_fns(op))


#: smaller attention cases for the interpreter, which runs a kernel's programs one by one in NumPy
_TRITON_LIMITS = {"paged_attention": {"max_len": 20}, "prefill_attention": {"max_q": 5}}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the masked-off lanes of the interpreter's blocks
@pytest.mark.skipif(not TRITON, reason="Triton's CPU interpreter is not in use (TRITON_INTERPRET=1 without a GPU)")
@pytest.mark.parametrize("op", [name for name in NAMES if any(p.op == name for p in TRITON)])
@fuzz_settings(20, share=0.2)
@given(data=st.data())
def test_triton_kernels_match_the_reference_on_valid_inputs(op, data):
    case = data.draw(valid_cases(op, **_TRITON_LIMITS.get(op, {})), label="case")
    COUNTS["valid (triton)", op] += 1
    honours_contract(OPS[op], case, triton_fns(op))


def _snapshot(args: tuple[Any, ...]) -> dict[int, torch.Tensor]:
    return {
        i: _storage(a).clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.device.type == "cpu"
    }


@pytest.mark.slow
@pytest.mark.parametrize("op", NAMES)
@fuzz_settings(150)
@given(data=st.data())
def test_every_provider_refuses_invalid_inputs(op, data):
    case = data.draw(invalid_cases(op), label="case")
    COUNTS["invalid", op] += 1
    # a structural violation is refused whether or not values are checked
    validate = case.values or data.draw(st.booleans(), label="validation on")
    for name, fn in cpu_fns(op) + triton_fns(op):
        before = _snapshot(case.args)
        with validation(validate), pytest.raises(OpInputError) as refused:
            fn(*case.args)
        message = str(refused.value)
        assert message.startswith(op), f"{name} refused {case.violation!r} without naming {op}: {message}"
        for i, storage in before.items():
            assert _identical(storage, _storage(case.args[i])), f"{name} wrote argument {i} before refusing: {case!r}"


def test_value_violations_need_validation_and_structural_ones_do_not():
    """What the policy promises: outside validation, no value is read (and nothing syncs); inside, it is."""
    op = OPS["embedding"]
    ids, weight = torch.tensor([0, 12]), torch.randn(10, 4)
    with validation(False):
        with pytest.raises(IndexError):  # torch's own refusal: the check did not read the ids
            op.reference(ids, weight)
    with validation(), pytest.raises(OpInputError, match=r"input_ids\[1\] is 12, outside \[0, 10\)"):
        op.reference(ids, weight)
    with validation(False), pytest.raises(OpInputError, match="input_ids must be"):
        op.reference(ids.float(), weight)


@pytest.mark.parametrize("op", NAMES)
def test_value_error_inputs_are_refused_under_validation_by_every_provider(op):
    cases = OPS[op].value_errors(torch.device("cpu"))
    for case in cases:
        for name, fn in cpu_fns(op) + triton_fns(op):
            with validation(), pytest.raises(OpInputError) as refused:
                fn(*case.args)
            assert case.match in str(refused.value), f"{name} refused {case.label!r} unclearly: {refused.value}"


def test_value_checks_skip_tensors_without_values():
    """Meta (and fake) tensors, as tracing passes them, have no values to read: the check stays structural."""
    ids, weight = torch.tensor([0, 12], device="meta"), torch.randn(10, 4, device="meta")
    with validation():
        check_embedding(ids, weight)


@pytest.mark.slow
def test_the_environment_turns_validation_on_for_the_process():
    import subprocess
    import sys

    code = (
        "import torch; from vllm_port.ops import embedding; from vllm_port.errors import OpInputError\n"
        "try:\n    embedding.reference(torch.tensor([12]), torch.randn(10, 4))\n"
        "except OpInputError as e:\n    print('refused:', e)\n"
    )
    env = {**os.environ, "VLLM_PORT_VALIDATE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "refused: embedding: input_ids[0] is 12" in done.stdout, done.stdout + done.stderr
