"""Tensor-parallel layers: the sharding math without processes, then the layers on 2 gloo ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

import vllm_port
from vllm_port.comm import Communicator, DistContext, TorchCollectives, TorchPointToPoint
from vllm_port.platform import PlatformDescription
from vllm_port.sharded_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_dim,
    split_range,
)
from vllm_port.spawn import run_ranks

CPU = PlatformDescription(name="cpu", device_type="cpu", priority=0, dist_backend="gloo")


@pytest.mark.parametrize("size,world", [(8, 2), (7, 2), (10, 4), (3, 4), (0, 2), (5, 1)])
def test_split_ranges_tile_the_dim_and_differ_by_at_most_one(size, world):
    ranges = [split_range(size, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    lengths = [e - s for s, e in ranges]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    assert [len(t) for t in torch.tensor_split(torch.arange(size), world)] == lengths


def test_split_range_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank 2"):
        split_range(4, 2, 2)


def test_shards_reassemble_the_full_weight():
    w = torch.arange(7 * 5.0).reshape(7, 5)
    assert torch.equal(torch.cat([ColumnParallelLinear.shard(w, r, 2).weight for r in range(2)]), w)
    assert torch.equal(torch.cat([RowParallelLinear.shard(w, r, 2).weight for r in range(2)], 1), w)
    emb = [VocabParallelEmbedding.shard(w, r, 3) for r in range(3)]
    assert [e.start for e in emb] == [0, 3, 5]
    assert torch.equal(torch.cat([e.weight for e in emb]), w)
    assert torch.equal(torch.cat([ParallelLMHead.shard(w, r, 2).weight for r in range(2)]), w)


def test_merged_column_weight_shards_each_piece():
    gate, up = torch.zeros(5, 2), torch.ones(5, 2)
    shards = [ColumnParallelLinear.shard(torch.cat([gate, up]), r, 2, output_sizes=[5, 5]) for r in range(2)]
    assert shards[0].weight.shape == (6, 2) and shards[1].weight.shape == (4, 2)
    assert torch.equal(shards[0].weight, torch.cat([gate[:3], up[:3]]))
    assert torch.equal(shards[1].weight, torch.cat([gate[3:], up[3:]]))
    with pytest.raises(ValueError, match="do not add up"):
        ColumnParallelLinear.shard(torch.zeros(9, 2), 0, 2, output_sizes=[5, 5])


def test_shard_dim_copies_contiguously():
    t = torch.arange(12.0).reshape(3, 4).t()
    assert shard_dim(t, 1, 1, 2).is_contiguous()


def test_one_rank_layers_equal_the_plain_ops():
    kernels = vllm_port.load(plugins="cpu", device="cpu").bind(torch.float32)
    comm = Communicator(TorchPointToPoint(), TorchCollectives())  # never called with one rank
    w, x = torch.randn(6, 4), torch.randn(3, 4)
    torch.testing.assert_close(ColumnParallelLinear.shard(w, 0, 1).forward(x, kernels, comm), x @ w.T)
    ids = torch.tensor([[0, 5, 2]])
    torch.testing.assert_close(VocabParallelEmbedding.shard(w, 0, 1).forward(ids, kernels, comm), w[ids])


def _tp_layers(ctx: DistContext) -> dict[str, torch.Tensor]:
    runtime = vllm_port.load(plugins="cpu", device="cpu")
    kernels, comm = runtime.bind(torch.float32), runtime.communicator()
    r, w = ctx.rank, ctx.world_size
    g = torch.Generator().manual_seed(1)
    vocab, hidden, inter = 11, 8, 13  # odd sizes: uneven shards
    emb, gate_up = torch.randn(vocab, hidden, generator=g), torch.randn(2 * inter, hidden, generator=g)
    down, head = torch.randn(hidden, inter, generator=g), torch.randn(vocab, hidden, generator=g)
    bias = torch.randn(hidden, generator=g)
    ids = torch.tensor([[0, 10, 5, 6], [3, 7, 1, 9]])
    h = VocabParallelEmbedding.shard(emb, r, w).forward(ids, kernels, comm)
    a = kernels.silu_and_mul(
        ColumnParallelLinear.shard(gate_up, r, w, output_sizes=[inter, inter]).forward(h, kernels, comm)
    )
    h = RowParallelLinear.shard(down, r, w, bias=bias).forward(a, kernels, comm)
    gathered = ColumnParallelLinear.shard(down.T.contiguous(), r, w, gather_output=True).forward(h, kernels, comm)
    logits = ParallelLMHead.shard(head, r, w).forward(h, kernels, comm)
    return {"h": h, "logits": logits, "gathered": gathered}


@pytest.mark.slow
def test_tp_layers_on_two_ranks_match_one_rank():
    ctx1 = DistContext(0, 1, 0, 1, "gloo", torch.device("cpu"))
    want = _tp_layers(ctx1)  # one rank: no communicator call is made
    for got in run_ranks(_tp_layers, CPU, 2, timeout_s=20):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-4)
