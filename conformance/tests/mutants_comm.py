"""Mutants of the comm parts: collectives and point-to-point that are right on small messages only.

Each bug sits in one call of a platform's comm parts (a subclass of core's torch.distributed parts
with the planted bug, as a vendor's own transport would go wrong), so one plugin holds a bug per
call and one ``vllm-port certify`` run checks them all; the all-reduce that stops at 2^24 elements
has a plugin of its own (its call already holds a bug). The plugins register no providers, like
the memory mutants: their runs do the platform, memory and comm checks. Each bug is in a class the
suite's samples did not reach before issue 25: dtypes the contract allows but the checks never
passed (float64), int64 values past 2^24, messages past 64 KiB, counts past 2^24.
"""

from __future__ import annotations

from certify_helpers import Mutant, MutantGroup

_PLATFORM = """
import torch
import torch.distributed as dist

from vllm_port import DeviceInfo, PlatformDescription, ProbeResult, hookimpl
from vllm_port.comm import TorchCollectives, TorchPointToPoint
from vllm_port.memory import host_memory

NAME = {name!r}


@hookimpl
def vllm_port_api_range():
    return ">=1.0,<2"


@hookimpl
def vllm_port_platform_describe():
    return PlatformDescription(name=NAME, device_type="cpu", priority=1, dist_backend="gloo")


@hookimpl
def vllm_port_platform_probe():
    return ProbeResult(True, "host memory as a test device", (DeviceInfo("test device", host_memory()[1], "test"),))


@hookimpl
def vllm_port_collectives(platform):
    return Collectives() if platform.name == NAME else None


@hookimpl
def vllm_port_point_to_point(platform):
    return PointToPoint() if platform.name == NAME else None
"""

ONE_BUG_PER_CALL = '''
#: messages up to this many bytes go in one eager send; larger ones in chunks of it
CHUNK = 64 << 10


class Collectives(TorchCollectives):
    """A vendor's collectives: a float-only reduction engine, a chunked broadcast, a vectorised gather."""

    name = "mutant collectives"

    def all_reduce(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in (torch.int64, torch.int32):
            return super().all_reduce(tensor)
        # BUG: the reduction engine adds floats only, so 32- and 64-bit integers ride in float32: exact below 2^24
        wide = tensor.to(torch.float32)
        super().all_reduce(wide)
        tensor.copy_(wide.round().to(tensor.dtype))
        return tensor

    def broadcast(self, tensor, src):
        if tensor.numel() * tensor.element_size() <= CHUNK:  # one eager send
            return super().broadcast(tensor, src)
        data = tensor.contiguous()
        raw = data.view(-1).view(torch.uint8)
        for i in range(max(1, raw.numel() // CHUNK)):  # BUG: floor, not ceiling: the last partial chunk never goes
            dist.broadcast(raw[i * CHUNK : (i + 1) * CHUNK], src)
        if data is not tensor:
            tensor.copy_(data)
        return tensor

    def all_gather(self, tensor, dim=0):
        if tensor.numel() * tensor.element_size() > CHUNK:  # the large-message path moves 16-byte vectors
            flat = tensor.contiguous().view(-1).clone()
            flat[flat.numel() - flat.numel() % (16 // tensor.element_size()) :] = 0  # BUG: the epilogue for the
            tensor = flat.view(tensor.shape)  # tail that fills no whole vector was never written
        return super().all_gather(tensor, dim)

    def reduce_scatter(self, tensor, dim=0):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float32:
            # BUG: accumulates in float32 "for accuracy": a gain for bfloat16 and float16, a loss for float64
            return super().reduce_scatter(tensor.float(), dim).to(tensor.dtype)
        return super().reduce_scatter(tensor, dim)


class PointToPoint(TorchPointToPoint):
    """A vendor's transport: an eager protocol up to 64 KiB, a rendezvous past it."""

    name = "mutant point-to-point"

    def recv(self, tensor, src):
        if tensor.numel() * tensor.element_size() <= CHUNK or not tensor.is_contiguous():
            return super().recv(tensor, src)
        landed = torch.empty_like(tensor)
        super().recv(landed, src)
        eager = CHUNK // tensor.element_size()
        tensor.view(-1)[:eager].copy_(landed.view(-1)[:eager])  # BUG: the rendezvous part is never copied out
        return None
'''

COUNT_24 = '''
class Collectives(TorchCollectives):
    """A vendor's all-reduce through one transfer descriptor."""

    name = "24-bit count collectives"

    def all_reduce(self, tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.numel() <= 1 << 24:
            return super().all_reduce(tensor)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        head = buf.view(-1)[: 1 << 24]  # BUG: one descriptor moves at most 2^24 elements; the rest stay unreduced
        super().all_reduce(head)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor


class PointToPoint(TorchPointToPoint):
    name = "torch point-to-point, as the plugin's"
'''


def _plugin(name: str, parts: str) -> str:
    return _PLATFORM.format(name=name) + parts


GROUPS: list[MutantGroup] = [
    MutantGroup(
        "comm-mutants",
        _plugin("comm-mutants", ONE_BUG_PER_CALL),
        (
            Mutant(
                "comm-int-via-float32",
                "all_reduce sends integers through float32 (a float-only reduction engine): int64 past 2^24 is rounded",
                "comm: dtype values",
                "test_comm[all_reduce[int64]]",
                ("all_reduce of 3x5", "values differ", "got 33554426, want 33554427"),
            ),
            Mutant(
                "comm-broadcast-chunk-tail",
                "broadcast sends 64 KiB chunks, rounding the count down: the tail of a message past 64 KiB never goes",
                "comm: message size",
                "test_comm[broadcast[bfloat16]]",
                ("broadcast from rank 1 of past 64 KiB", "values differ"),
            ),
            Mutant(
                "comm-gather-vector-tail",
                "all_gather's path for messages past 64 KiB moves 16-byte vectors and leaves the tail zero",
                "comm: message size",
                "test_comm[all_gather[float32]]",
                ("all_gather(dim=0) of past 64 KiB", "values differ"),
            ),
            Mutant(
                "comm-recv-eager-only",
                "recv of a message past 64 KiB keeps the eager part only: the rendezvous bytes are never copied out",
                "comm: message size",
                "test_comm[p2p[int64]]",
                ("send/recv of past 64 KiB", "values differ"),
            ),
            Mutant(
                "comm-reduce-scatter-float32",
                "reduce_scatter accumulates every float dtype in float32: float64 loses its low bits",
                "comm: dtype values",
                "test_comm[reduce_scatter[float64]]",
                ("reduce_scatter(dim=0)", "values differ"),
            ),
        ),
    ),
    MutantGroup(
        "comm-count-24",
        _plugin("comm-count-24", COUNT_24),
        (
            Mutant(
                "comm-count-24",
                "all_reduce moves at most 2^24 elements in its one descriptor: a prefill chunk's tail is not reduced",
                "comm: element count",
                "test_comm[all_reduce_past_2^24_elements[bfloat16]]",
                ("all_reduce of 16,777,219 bfloat16", "3 of 16,777,219 values differ", "flat index 16,777,216"),
            ),
        ),
    ),
]
