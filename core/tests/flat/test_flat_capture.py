"""Decode graphs captured per batch size, replaying the nearest larger size with padding rows.

CPU has no graph capture: ``CallingCapture`` stands in (a replay calls the step), which is enough
to check bucketing and padding. The GPU test runs the CUDA plugin's CUDA graphs with compilation off.
"""

from __future__ import annotations

import pytest
import torch
from calling_capture import CallingCapture
from paged_harness import Conversation

import vllm_port
from vllm_port.flat.capture import DecodeGraphs, padded_batch_sizes
from vllm_port.flat.flat_model import FlatModel
from vllm_port.models import load_model


def _echo(ids, positions, slots, tables, lens):
    """A step whose output rows show what it was given."""
    return torch.stack([ids.float(), positions.float(), slots.float(), tables.float().sum(1), lens.float()], dim=1)


def _batch(n, width=3):
    ids = torch.arange(10, 10 + n)
    return ids, ids + 100, ids + 200, torch.ones(n, width, dtype=torch.int32), torch.full((n,), 7, dtype=torch.int32)


def test_batch_replays_the_smallest_captured_size_with_padding_rows():
    capture = CallingCapture()
    graphs = DecodeGraphs(_echo, capture, [1, 2, 4, 8], max_blocks_per_seq=5, device="cpu")
    assert len(capture.captured) == 4
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    out = graphs(*_batch(3))
    assert out.shape == (3, 5)
    torch.testing.assert_close(out, _echo(*_batch(3)))
    # the fourth row of the size-4 graph is a padding sequence: token 0 at 0, written nowhere, reading nothing
    assert graphs.input_ids[3] == 0 and graphs.positions[3] == 0 and graphs.slot_mapping[3] == -1
    assert graphs.seq_lens[3] == 0 and graphs.block_tables[3].eq(0).all()
    out = graphs(*_batch(5))  # a later, larger batch overwrites every row it uses
    torch.testing.assert_close(out, _echo(*_batch(5)))
    assert graphs.slot_mapping[5:8].eq(-1).all() and graphs.seq_lens[5:8].eq(0).all()


def test_batches_the_graphs_cannot_hold_are_refused():
    graphs = DecodeGraphs(_echo, CallingCapture(), [1, 4], max_blocks_per_seq=2, device="cpu")
    with pytest.raises(ValueError, match=r"a batch of 5 sequences; captured sizes are 1..4"):
        graphs(*_batch(5, width=2))
    with pytest.raises(ValueError, match=r"block_tables has 3 columns .* max_blocks_per_seq=2"):
        graphs(*_batch(2, width=3))
    with pytest.raises(ValueError, match="batch_sizes must be positive"):
        DecodeGraphs(_echo, CallingCapture(), [0, 2], max_blocks_per_seq=2, device="cpu")
    assert padded_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.slow
def test_the_graphs_keep_their_step_alive():
    """A graph holds raw addresses of what its step closed over: that memory must not be freed under it."""
    import gc
    import weakref

    class ForgetfulCapture(CallingCapture):  # like a real capture: the replay does not hold the step
        def capture(self, step, warmup=2):
            out = step()
            return lambda: out

    def make_step():
        rows = torch.arange(4)  # what a step closes over, as the engine's decode step does

        def step(*args):
            return rows

        return step

    step = make_step()
    alive = weakref.ref(step)
    graphs = DecodeGraphs(step, ForgetfulCapture(), [1, 4], max_blocks_per_seq=2, device="cpu")
    del step
    gc.collect()
    assert alive() is not None and graphs.step is alive()


def test_capturing_is_marked_so_value_checks_stand_aside():
    """No host read may happen while a graph records: checks ask vllm_port.graph_capture, not a device module."""
    from vllm_port.graph_capture import is_capturing
    from vllm_port.ops._checks import reads_values, validation

    seen = []

    def step(input_ids, *rest):
        seen.append((is_capturing(), reads_values(input_ids)))
        return input_ids

    with validation():
        assert reads_values(torch.zeros(1))
        DecodeGraphs(step, CallingCapture(), [1, 2], max_blocks_per_seq=2, device="cpu")
        assert reads_values(torch.zeros(1)) and not is_capturing()
    assert seen and all(s == (True, False) for s in seen)


@pytest.mark.slow
def test_padding_rows_leave_the_cache_untouched(tiny_dirs, cpu_runtime):
    model = load_model(tiny_dirs["qwen2"], torch.device("cpu"), torch.float32)
    runner = FlatModel(model, cpu_runtime, compile=False, block_size=4)
    talk = Conversation(model.config, [5, 9], decode_steps=1)
    runner.forward(*talk.prefill()[:2], talk.kv_caches, talk.prefill()[2])
    graphs = runner.capture_decode(talk.kv_caches, [8], talk.tables.shape[1], capture=CallingCapture())
    before = [c.clone() for pair in talk.kv_caches for c in pair]
    ids, pos, meta = talk.decode(0)
    graphs(ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens)
    after = [c for pair in talk.kv_caches for c in pair]
    written = torch.zeros(before[0].shape[:2], dtype=torch.bool)
    written.view(-1)[meta.slot_mapping] = True  # the two real tokens' slots, nothing else
    for old, new in zip(before, after, strict=True):
        changed = ~((old == new) | (old.isnan() & new.isnan())).all(-1).all(-1)
        assert torch.equal(changed, written)


def test_eager_decode_captured_with_cuda_graphs_matches_transformers(tiny_dirs):
    runtime = vllm_port.load()
    capture = runtime.graph_capture()
    if capture is None:
        pytest.skip(
            f"platform {runtime.platform.name!r} has no graph capture; this runs on the CUDA plugin (dev/gpu-run)"
        )
    model = load_model(tiny_dirs["llama"], runtime.device, torch.float32)
    runner = FlatModel(model, runtime, compile=False, block_size=4)  # compilation off: bound kernels + capture
    assert runner.mode == "eager"
    talk = Conversation(model.config, [8, 15, 11], decode_steps=4, seed=2)  # batches built on the host, then moved
    talk.kv_caches = [(k.to(runtime.device), v.to(runtime.device)) for k, v in talk.kv_caches]
    ids, pos, meta = talk.prefill()
    meta = type(meta)(*(x.to(runtime.device) if isinstance(x, torch.Tensor) else x for x in vars(meta).values()))
    runner.forward(ids.to(runtime.device), pos.to(runtime.device), talk.kv_caches, meta)
    graphs = runner.capture_decode(talk.kv_caches, [1, 2, 4, 8], talk.tables.shape[1], capture=capture)
    eager_step = runner.decode_step(talk.kv_caches)
    for t in range(4):
        ids, pos, meta = talk.decode(t)
        args = [x.to(runtime.device) for x in (ids, pos, meta.slot_mapping, meta.block_tables, meta.seq_lens)]
        replayed = graphs(*args).float().cpu()
        want = talk.expected_decode(tiny_dirs["llama"], t)
        # fp32 Triton attention multiplies in TF32 on tensor cores: looser than the CPU's bound
        torch.testing.assert_close(replayed, want, atol=5e-3, rtol=5e-3)
        args[2] = torch.full_like(args[2], -1)  # the replay already wrote this step's K/V: do not write twice
        torch.testing.assert_close(eager_step(*args).float().cpu(), replayed, atol=1e-5, rtol=1e-5)
