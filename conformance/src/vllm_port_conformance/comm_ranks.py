"""The rank side of the comm checks: run in each spawned rank, report one result per check.

Each check returns ``None`` when it passes or a message; exceptions are caught per check and
reported with the rank, so one failure does not hide the others. Inputs are rank-dependent with
known results.

The checks run on two ranks where the platform has two devices (or is the host CPU, whose ranks
share it), and on a world of one where it has one: every collective and the tensor-parallel layers
still run on the one rank, and the checks that need a second rank (:data:`MULTI_RANK_CHECKS`) are
out of that run's scope.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

import vllm_port
from vllm_port.comm import Communicator, DistContext, TorchCollectives
from vllm_port.errors import CommCapabilityError, CommInputError, CommShapeMismatchError
from vllm_port.sharded_layers import ColumnParallelLinear, RowParallelLinear
from vllm_port_conformance.comm_memory_classes import (
    COMM_CALLS,
    COMM_DTYPES,
    LARGE_ALL_REDUCE,
    MESSAGE_SIZES,
    message_numel,
    wide_values,
)

#: ranks the comm checks use when the devices allow
WORLD_SIZE = 2


def _tag(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: one check per call and dtype, each over every message size (generated from the declared classes)
PER_DTYPE_CHECKS = tuple(f"{call}[{_tag(dt)}]" for dt in COMM_DTYPES for call in COMM_CALLS)
LARGE_CHECK = f"all_reduce_past_2^24_elements[{_tag(LARGE_ALL_REDUCE.dtype)}]"
CHECK_NAMES = (
    *PER_DTYPE_CHECKS,
    LARGE_CHECK,
    "non_contiguous",
    "shape_mismatch",
    "bad_input",
    "p2p_ring",
    "replaced_collectives_keep_p2p",
    "barrier",
    "tp_mlp",
)
#: checks that mean nothing on one rank: a peer to send to, a peer whose shape differs
MULTI_RANK_CHECKS = ("shape_mismatch", "p2p_ring", *(f"p2p[{_tag(dt)}]" for dt in COMM_DTYPES))


def comm_world_size(device_type: str, device_count: int, devices: int | None = None) -> int:
    """The ranks the comm checks run on: one per device, at most :data:`WORLD_SIZE`.

    :param device_count: the devices the probe found.
    :param devices: certify for this many devices (``--vllm-port-devices``); ``None``: as found.
        Ranks of the host CPU share it, so ``cpu`` runs :data:`WORLD_SIZE` ranks unless told fewer.
    :raises ValueError: for fewer than one device asked, or more than a device platform has.
    """
    if devices is not None:
        if devices < 1:
            raise ValueError(f"certify for {devices} devices: give at least 1")
        if device_type != "cpu" and devices > device_count:
            raise ValueError(f"certify for {devices} {device_type} devices: the probe found only {device_count}")
        return min(WORLD_SIZE, devices)
    return WORLD_SIZE if device_type == "cpu" else min(WORLD_SIZE, device_count)


class ReplacementCollectives(TorchCollectives):
    """A stand-in plugin's collectives: serves all but reduce_scatter."""

    name = "conformance replacement collectives"
    capabilities = TorchCollectives.capabilities - {"reduce_scatter"}


def _data(shape: tuple[int, ...], rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (torch.arange(_numel(shape)).reshape(shape) % 13 + 10 * rank).to(dtype=dtype, device=device)


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    got, want = got.cpu(), want.cpu()
    if torch.equal(got, want):
        return
    wrong = (got != want).flatten().nonzero().flatten()
    first = int(wrong[0]) if wrong.numel() else 0
    raise AssertionError(
        f"{what}: {wrong.numel():,} of {want.numel():,} values differ, the first at flat index {first:,}: "
        f"got {got.flatten()[first].item()!r}, want {want.flatten()[first].item()!r}"
    )


class _Tally:
    """The cases of one check that went wrong, raised together once every case has run.

    A check's cases are collectives: a rank that stopped at its first wrong value would leave its
    peers waiting in the next case, and every later check would time out.
    """

    def __init__(self) -> None:
        self.problems: list[str] = []

    def eq(self, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        try:
            _eq(got, want, what)
        except AssertionError as exc:
            self.problems.append(str(exc))

    def settle(self) -> None:
        if self.problems:
            more = f" (and {len(self.problems) - 1} more case(s) wrong)" if len(self.problems) > 1 else ""
            raise AssertionError(self.problems[0] + more)


def _expect(exc: type[BaseException], fn: Callable[[], object], *must_contain: str) -> None:
    try:
        fn()
    except exc as e:
        for s in must_contain:
            if s not in str(e):
                raise AssertionError(f"{exc.__name__} raised but its message lacks {s!r}: {e}") from e
        return
    raise AssertionError(f"expected {exc.__name__}, nothing raised")


def _sized(dtype: torch.dtype) -> list[tuple[str, int]]:
    """``(label, elements)`` of every message size class for ``dtype``."""
    return [
        (f"{size.label}, {message_numel(size, dtype):,} {_tag(dtype)}", message_numel(size, dtype))
        for size in MESSAGE_SIZES
    ]


def _per_dtype_checks(
    comm: Communicator, r: int, w: int, dev: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """Each of :data:`COMM_CALLS` for ``dtype``: its shape cases, then every message size, on values of the dtype's whole width."""

    longest = max(n for _, n in _sized(dtype)) + w  # the uneven all_gather's last rank holds w - 1 more
    pools: dict[int, torch.Tensor] = {}  # rank -> its values, made once: every case takes a prefix

    def values(shape: tuple[int, ...], rank: int) -> torch.Tensor:
        if rank not in pools:
            pools[rank] = wide_values(dtype, longest, rank, w, dev)
        return pools[rank][: _numel(shape)].reshape(shape).clone()  # a copy: in-place calls write into it

    def total(shape: tuple[int, ...]) -> torch.Tensor:
        return sum(values(shape, k) for k in range(w))  # exact: the values sum without rounding

    def all_reduce() -> None:
        tally = _Tally()
        for label, n in [("3x5", 15), *_sized(dtype)]:
            tally.eq(comm.all_reduce(values((n,), r)), total((n,)), f"all_reduce of {label}")
        tally.settle()

    def all_gather() -> None:
        tally = _Tally()
        cases = [((2, 3), dim, "2x3") for dim in (0, 1, -1)]
        cases += [((1, n), dim, label) for label, n in _sized(dtype) for dim in (0, -1)]
        for shape, dim, label in cases:
            got = comm.all_gather(values(shape, r), dim=dim)
            tally.eq(got, torch.cat([values(shape, k) for k in range(w)], dim), f"all_gather(dim={dim}) of {label}")
        tally.settle()

    def all_gather_uneven() -> None:
        tally = _Tally()
        # rank k holds k more columns: the logits of a vocabulary that does not split evenly
        for label, n in [("3 rows", 3), *_sized(dtype)]:
            rows, cols = (3, 1) if n == 3 else (1, n // 2)
            got = comm.all_gather(values((rows, cols + r), r), dim=-1)
            want = torch.cat([values((rows, cols + k), k) for k in range(w)], -1)
            tally.eq(got, want, f"all_gather(dim=-1) uneven, {label}")
        tally.settle()

    def reduce_scatter() -> None:
        tally = _Tally()
        cases = [((2 * w, 3), 0, "even rows"), ((3, 2 * w), 1, "even columns"), ((2 * w + 1, 2), 0, "odd rows")]
        cases += [((n,), 0, label) for label, n in _sized(dtype)]  # odd counts: the first ranks get one more
        for shape, dim, label in cases:
            got = comm.reduce_scatter(values(shape, r), dim=dim)
            tally.eq(
                got, torch.tensor_split(total(shape), w, dim)[r], f"reduce_scatter(dim={dim}) of {shape} ({label})"
            )
        tally.settle()

    def broadcast() -> None:
        tally = _Tally()
        src = w - 1
        for label, n in [("4 values", 4), *_sized(dtype)]:
            tally.eq(
                comm.broadcast(values((n,), r), src=src), values((n,), src), f"broadcast from rank {src} of {label}"
            )
        tally.settle()

    def p2p() -> None:
        tally = _Tally()
        for label, n in _sized(dtype):
            into = torch.zeros(n, dtype=dtype, device=dev)
            comm.batch_isend_irecv([(values((n,), r), (r + 1) % w)], [(into, (r - 1) % w)])
            tally.eq(into, values((n,), (r - 1) % w), f"batch_isend_irecv ring of {label}")
            if r < 2:  # rank 0 sends, rank 1 receives
                if r == 0:
                    comm.send(values((n,), 0), 1)
                else:
                    into = torch.zeros(n, dtype=dtype, device=dev)
                    comm.recv(into, 0)
                    tally.eq(into, values((n,), 0), f"send/recv of {label}")
        tally.settle()

    named = dict(
        all_reduce=all_reduce,
        all_gather=all_gather,
        all_gather_uneven=all_gather_uneven,
        reduce_scatter=reduce_scatter,
        broadcast=broadcast,
        p2p=p2p,
    )
    return {call: named[call] for call in COMM_CALLS}


def _all_reduce_past_2_24(comm: Communicator, r: int, w: int, dev: torch.device) -> None:
    """The prefill chunk's all-reduce: more elements than 2^24, each checked."""
    n, dtype = LARGE_ALL_REDUCE.numel, LARGE_ALL_REDUCE.dtype
    tile = torch.arange(61).to(dtype)  # small integers: every sum exact; 61 does not divide 2^24
    reps = -(-n // tile.numel())
    got = comm.all_reduce((tile + 60 * r).repeat(reps)[:n].to(dev))
    _eq(
        got, (tile * w + 60 * sum(range(w))).repeat(reps)[:n], f"all_reduce of {n:,} {_tag(dtype)} (past 2^24 elements)"
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def run_checks(
    ctx: DistContext, plugin: str, platform: str, only: tuple[str, ...] | None = None
) -> dict[str, str | None]:
    """Every check of :data:`CHECK_NAMES` (``only``: those named there) on this rank; ``None`` or a message each."""
    runtime = vllm_port.load(plugins=plugin, device=platform)
    comm = runtime.communicator()
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    checks: dict[str, Callable[[], None]] = {}

    for dtype in COMM_DTYPES:
        for call, check in _per_dtype_checks(comm, r, w, dev, dtype).items():
            checks[f"{call}[{_tag(dtype)}]"] = check
    checks[LARGE_CHECK] = lambda: _all_reduce_past_2_24(comm, r, w, dev)

    def non_contiguous() -> None:
        base = _data((4, 6), r, torch.float32, dev)
        view = base.t()[1:5]  # a strided view
        comm.all_reduce(view)
        want = sum(_data((4, 6), k, torch.float32, dev) for k in range(w)).t()[1:5]
        _eq(view, want, "all_reduce into a view")
        got = comm.all_gather(_data((4, 6), r, torch.float32, dev).t(), dim=1)
        _eq(got, torch.cat([_data((4, 6), k, torch.float32, dev).t() for k in range(w)], 1), "all_gather of .t()")
        b = _data((6, 4), r, torch.float32, dev).t()
        comm.broadcast(b, src=0)
        _eq(b, _data((6, 4), 0, torch.float32, dev).t(), "broadcast into .t()")

    def shape_mismatch() -> None:
        _expect(
            CommShapeMismatchError,
            lambda: comm.all_gather(_data((2, 3 + r), r, torch.float32, dev), dim=0),
            f"rank {r}",
            "all_gather",
            "rank 0: float32[2, 3]",
            "rank 1: float32[2, 4]",
        )

    def bad_input() -> None:
        _expect(CommInputError, lambda: comm.all_reduce([1.0]), f"rank {r}", "all_reduce")  # type: ignore[arg-type]
        _expect(CommInputError, lambda: comm.all_reduce(torch.zeros(2, dtype=torch.complex64, device=dev)), "dtype")
        _expect(CommInputError, lambda: comm.send(torch.zeros(2, device=dev), r), f"rank {r}", "send")
        _expect(CommInputError, lambda: comm.broadcast(torch.zeros(2, device=dev), w), "broadcast", "src")
        _expect(CommInputError, lambda: comm.all_gather(torch.zeros(2, device=dev), dim=3), "dim=3")

    def p2p_ring(c: Communicator = comm) -> None:
        out = torch.empty(3, 2, device=dev, dtype=torch.bfloat16)
        c.batch_isend_irecv([(_data((3, 2), r, torch.bfloat16, dev), (r + 1) % w)], [(out, (r - 1) % w)])
        _eq(out, _data((3, 2), (r - 1) % w, torch.bfloat16, dev), "ring exchange")
        if r == 0:
            c.send(_data((2, 3), 0, torch.int64, dev).t(), 1)
        elif r == 1:
            into = torch.empty(2, 3, dtype=torch.int64, device=dev).t()
            c.recv(into, 0)
            _eq(into, _data((2, 3), 0, torch.int64, dev).t(), "send/recv into .t()")

    def replaced_collectives() -> None:
        mixed = Communicator(comm.point_to_point, ReplacementCollectives())
        assert mixed.served_by_call["all_reduce"] == ReplacementCollectives.name, mixed.served_by_call
        assert mixed.served_by_call["send"] == comm.point_to_point.name, mixed.served_by_call
        if w >= 2:  # point-to-point needs a peer
            p2p_ring(mixed)
        _eq(mixed.all_reduce(torch.ones(2, device=dev)), torch.full((2,), float(w), device=dev), "replaced all_reduce")
        _expect(
            CommCapabilityError, lambda: mixed.reduce_scatter(torch.ones(2, device=dev)), "reduce_scatter", f"rank {r}"
        )

    def barrier() -> None:
        comm.barrier()

    def tp_mlp() -> None:
        kernels = runtime.bind(torch.float32)
        hidden, inter = 16, 23  # odd: uneven shards
        g = torch.Generator().manual_seed(0)
        gate_up = torch.randn(2 * inter, hidden, generator=g).to(dev)
        down = torch.randn(hidden, inter, generator=g).to(dev)
        x = torch.randn(5, hidden, generator=g).to(dev)
        want = kernels.linear(kernels.silu_and_mul(kernels.linear(x, gate_up, None)), down, None)
        col = ColumnParallelLinear.shard(gate_up, r, w, output_sizes=[inter, inter])
        row = RowParallelLinear.shard(down, r, w)
        got = row.forward(kernels.silu_and_mul(col.forward(x, kernels, comm)), kernels, comm)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)

    checks.update(
        non_contiguous=non_contiguous,
        shape_mismatch=shape_mismatch,
        bad_input=bad_input,
        p2p_ring=p2p_ring,
        replaced_collectives_keep_p2p=replaced_collectives,
        barrier=barrier,
        tp_mlp=tp_mlp,
    )
    if w < 2:
        for name in MULTI_RANK_CHECKS:
            del checks[name]
    if only is not None:
        checks = {name: fn for name, fn in checks.items() if name in only}
    results: dict[str, str | None] = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = f"rank {r} (comm served by {comm.served_by}): {traceback.format_exc(limit=4)}"
    return results
