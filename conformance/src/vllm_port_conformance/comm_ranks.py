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
from vllm_port.parallel import ColumnParallelLinear, RowParallelLinear

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
#: ranks the comm checks use when the devices allow
WORLD_SIZE = 2
#: checks that mean nothing on one rank: a peer to send to, a peer whose shape differs
MULTI_RANK_CHECKS = ("shape_mismatch", "p2p_ring")


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
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n).reshape(shape) % 13 + 10 * rank).to(dtype=dtype, device=device)


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(
            f"{what}: values differ: got {got.flatten()[:8].tolist()} want {want.flatten()[:8].tolist()}"
        )


def _expect(exc: type[BaseException], fn: Callable[[], object], *must_contain: str) -> None:
    try:
        fn()
    except exc as e:
        for s in must_contain:
            if s not in str(e):
                raise AssertionError(f"{exc.__name__} raised but its message lacks {s!r}: {e}") from e
        return
    raise AssertionError(f"expected {exc.__name__}, nothing raised")


def run_checks(ctx: DistContext, plugin: str, platform: str) -> dict[str, str | None]:
    runtime = vllm_port.load(plugins=plugin, device=platform)
    comm = runtime.communicator()
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    checks: dict[str, Callable[[], None]] = {}

    for dtype in DTYPES:
        tag = str(dtype).removeprefix("torch.")

        def all_reduce(dtype: torch.dtype = dtype) -> None:
            got = comm.all_reduce(_data((3, 5), r, dtype, dev))
            _eq(got, sum(_data((3, 5), k, dtype, dev) for k in range(w)), "all_reduce")

        def all_gather(dtype: torch.dtype = dtype) -> None:
            for dim in (0, 1, -1):
                got = comm.all_gather(_data((2, 3), r, dtype, dev), dim=dim)
                _eq(got, torch.cat([_data((2, 3), k, dtype, dev) for k in range(w)], dim), f"all_gather dim={dim}")

        def all_gather_uneven(dtype: torch.dtype = dtype) -> None:
            got = comm.all_gather(_data((3, r + 1), r, dtype, dev), dim=1)
            _eq(got, torch.cat([_data((3, k + 1), k, dtype, dev) for k in range(w)], 1), "all_gather uneven")

        def reduce_scatter(dtype: torch.dtype = dtype) -> None:
            for shape, dim in (((2 * w, 3), 0), ((3, 2 * w), 1), ((2 * w + 1, 2), 0)):
                total = sum(_data(shape, k, dtype, dev) for k in range(w))
                got = comm.reduce_scatter(_data(shape, r, dtype, dev), dim=dim)
                _eq(got, torch.tensor_split(total, w, dim)[r], f"reduce_scatter {shape} dim={dim}")

        def broadcast(dtype: torch.dtype = dtype) -> None:
            src = w - 1
            got = comm.broadcast(_data((4,), r, dtype, dev), src=src)
            _eq(got, _data((4,), src, dtype, dev), "broadcast")

        for name, fn in (
            ("all_reduce", all_reduce),
            ("all_gather", all_gather),
            ("all_gather_uneven", all_gather_uneven),
            ("reduce_scatter", reduce_scatter),
            ("broadcast", broadcast),
        ):
            checks[f"{name}[{tag}]"] = fn

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
    results: dict[str, str | None] = {}
    for name, fn in checks.items():
        try:
            fn()
            results[name] = None
        except Exception:
            results[name] = f"rank {r}: {traceback.format_exc(limit=4)}"
    return results
