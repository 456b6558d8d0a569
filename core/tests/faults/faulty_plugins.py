"""Sources of broken test plugins, installed for real by ``install_plugin`` (``core/tests/plugin_factory.py``).

Most are *adapter* plugins: no platform of their own, one provider registered for the ``cpu``
platform at a priority above the CPU plugin's, so binding on ``cpu`` chooses it first and the CPU
plugin's provider is the next candidate, as a vendor library's adapter (AITER, IPEX) would stand.
"""

from __future__ import annotations

import textwrap

ADAPTER = """
import dataclasses, time
import torch
from vllm_port import hookimpl
from vllm_port.ops import provider, {ops}

CALLS = {{}}  # calls per provider, for faults that strike now and then

@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"

{providers}

@hookimpl
def vllm_port_providers():
    return [dataclasses.replace(p, platform="cpu") for p in ({names},)]
"""

#: fault -> (op, body of ``zf_<op>`` with the op's own arguments; ``REF`` is the op's reference)
FAULTS: dict[str, tuple[str, str]] = {
    "raises": ("rms_norm", "raise RuntimeError('kernel launch failed: invalid device function')"),
    "wrong shape": ("rms_norm", "return REF(x, weight, epsilon)[..., :-1].contiguous()"),
    "wrong dtype": ("rms_norm", "return REF(x, weight, epsilon).to(torch.float64)"),
    "wrong device": ("rms_norm", "return torch.empty(x.shape, dtype=x.dtype, device='meta')"),
    "NaN": ("rms_norm", "out = REF(x, weight, epsilon)\n    out[0, 0] = float('nan')\n    return out"),
    "wrong values": ("rms_norm", "return REF(x, weight, epsilon) * 1.5"),
    "slow": ("rms_norm", "time.sleep(0.05)\n    return REF(x, weight, epsilon)"),
    # an in-place op that writes its in-place argument wrong: the residual added twice
    "wrong in place": (
        "fused_add_rms_norm",
        "residual.add_(x)\n    return REF(x, residual, weight, epsilon)",
    ),
    # right for one row, the wrong shape from two rows on: only a check of every call sees it
    "wrong shape later": (
        "rms_norm",
        "out = REF(x, weight, epsilon)\n    return out if x.shape[0] == 1 else out[:-1].contiguous()",
    ),
    # the doctor's mix: one fault per op
    "embedding wrong device": (
        "embedding",
        "return torch.empty((*input_ids.shape, weight.shape[1]), dtype=weight.dtype, device='meta')",
    ),
    "silu wrong shape": ("silu_and_mul", "return REF(x)[..., :-1].contiguous()"),
    "gelu wrong dtype": ("gelu_and_mul", "return REF(x, approximate).to(torch.float64)"),
    "linear NaN": ("linear", "out = REF(x, weight, bias)\n    out.view(-1)[0] = float('nan')\n    return out"),
    # faults at run time that only values show (issue 25): NaN now and then, ids outside the vocabulary
    "linear NaN every 11th": (
        "linear",
        "CALLS['linear'] = CALLS.get('linear', 0) + 1\n    out = REF(x, weight, bias)\n"
        "    if CALLS['linear'] % 11 == 0:\n        out.view(-1)[0] = float('nan')\n    return out",
    ),
    "rms_norm NaN every 7th": (
        "rms_norm",
        "CALLS['rms_norm'] = CALLS.get('rms_norm', 0) + 1\n    out = REF(x, weight, epsilon)\n"
        "    if CALLS['rms_norm'] % 7 == 0:\n        out.view(-1)[0] = float('nan')\n    return out",
    ),
    # the last row of the table read as NaN: only a request holding the last token id meets it
    "embedding NaN last row": (
        "embedding",
        "out = REF(input_ids, weight)\n    out[input_ids == weight.shape[0] - 1] = float('nan')\n    return out",
    ),
    "sample id past the vocabulary": (
        "sample",
        "out = REF(logits, temperature, top_k, top_p, seeds)\n    out[-1] = logits.shape[1]\n    return out",
    ),
    # now and then: debug mode's first-call comparison does not see it
    "sample id past the vocabulary every 3rd": (
        "sample",
        "CALLS['sample'] = CALLS.get('sample', 0) + 1\n    out = REF(logits, temperature, top_k, top_p, seeds)\n"
        "    if CALLS['sample'] % 3 == 0:\n        out[-1] = logits.shape[1]\n    return out",
    ),
    "sample one id short": ("sample", "return REF(logits, temperature, top_k, top_p, seeds)[:-1]"),
    "sample negative id": (
        "sample",
        "out = REF(logits, temperature, top_k, top_p, seeds)\n    out[-1] = -1\n    return out",
    ),
    "rotary slow": (
        "rotary_embedding",
        "time.sleep(0.05)\n    return REF(positions, query, key, head_size, cos_sin_cache, is_neox)",
    ),
}

_SIGNATURES = {
    "rms_norm": "x, weight, epsilon",
    "fused_add_rms_norm": "x, residual, weight, epsilon",
    "embedding": "input_ids, weight",
    "silu_and_mul": "x",
    "gelu_and_mul": "x, approximate='none'",
    "linear": "x, weight, bias=None",
    "rotary_embedding": "positions, query, key, head_size, cos_sin_cache, is_neox",
    "sample": "logits, temperature, top_k, top_p, seeds",
}


def adapter(*faults: str) -> str:
    """An adapter plugin whose provider ``zf_<op>`` for each fault's op (priority 100, platform ``cpu``) has that fault."""
    ops = sorted({FAULTS[f][0] for f in faults})
    bodies = []
    for fault in faults:
        op, body = FAULTS[fault]
        body = body.replace("REF(", f"{op}.reference(")
        bodies.append(f"@provider({op!r}, priority=100)\ndef zf_{op}({_SIGNATURES[op]}):\n    {body}\n")
    names = ", ".join(f"zf_{FAULTS[f][0]}" for f in faults)
    return ADAPTER.format(ops=", ".join(ops), providers="\n".join(bodies), names=names)


def lying_allocator(mem_info: str) -> str:
    """A platform plugin (``zmem``, priority 50: selected over ``cpu``) whose allocator's ``_mem_info`` is ``mem_info``."""
    from plugin_factory import healthy

    return healthy(
        "zmem",
        priority=50,
        extra=textwrap.dedent(
            f"""
            from vllm_port.memory import HostMemoryAllocator

            class LyingAllocator(HostMemoryAllocator):
                def __init__(self):
                    super().__init__(pinned=False, name="zmem allocator")

                def _mem_info(self):
                    {mem_info}

            @hookimpl
            def vllm_port_allocator(platform):
                return LyingAllocator()
            """
        ),
    )


#: A collectives part whose calls fail as a backend does when a peer never answers.
TIMING_OUT_COMM = """
from vllm_port import hookimpl
from vllm_port.comm import TorchCollectives

class SlowCollectives(TorchCollectives):
    name = "zcomm collectives"

    def all_reduce(self, tensor):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 30000ms for recv operation to complete")

    def barrier(self):
        raise TimeoutError("no answer from rank 1 within 30 s")

    def broadcast(self, tensor, src):
        raise ValueError("descriptor table full")

@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"

@hookimpl
def vllm_port_collectives(platform):
    return SlowCollectives()
"""
