"""A placed model computes what the unplaced one does, with the transfers its policy cuts, and no others."""

from __future__ import annotations

import pytest
import torch
from paged_harness import Conversation
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_port.flat import FlatModel
from vllm_port.flat.flat_graph import op_targets
from vllm_port.placement import PlacedModel, load_many, place

MLP_ON_B = [{"platform": "cpu-b", "part": "mlp"}]
POLICIES = {
    "mlp": MLP_ON_B,
    "lm_head": [{"platform": "cpu-b", "part": "lm_head"}],
    "mlp of layer 1 and head": [
        {"platform": "cpu-b", "part": "mlp", "layers": "1"},
        {"platform": "cpu-b", "part": "lm_head"},
    ],
    "layer 1 whole (kv on cpu-b)": [{"platform": "cpu-b", "layers": [1, 1]}],
    # rotary writes q and k in place, views of the q/k/v projection made on cpu: written back home
    "rotary": [{"platform": "cpu-b", "op": "rotary_embedding"}],
    "norms by node name": [{"platform": "cpu-b", "node": "*rms_norm*"}],
    "default cpu-b": {"default": "cpu-b", "rules": [{"platform": "cpu", "weight": "layers.0.*"}]},
}


def _steps(model_forward, logits, conv: Conversation, decode_steps: int) -> list[torch.Tensor]:
    ids, positions, meta = conv.prefill()
    rows = meta.cu_seqlens_q[1:].long() - 1
    out = [logits(model_forward(ids, positions, conv.kv_caches, meta), rows, "prefill")]
    for step in range(decode_steps):
        ids, positions, meta = conv.decode(step)
        out.append(logits(model_forward(ids, positions, conv.kv_caches, meta), torch.arange(len(ids)), "decode"))
    return out


#: Every policy on the fused graph; two on the unfused one (its extra nodes are views and torch ops).
CASES = [(name, True) for name in POLICIES] + [("mlp", False), ("rotary", False)]


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "passes"), CASES, ids=[f"{n}-{'fused' if p else 'unfused'}" for n, p in CASES])
def test_placed_logits_equal_unplaced(llama, platforms, policy: str, passes: bool) -> None:
    placed = PlacedModel(llama, POLICIES[policy], platforms, passes=passes)
    reference = FlatModel(llama, platforms["cpu"], compile=False, passes=passes)
    got = _steps(placed.forward, placed.logits, Conversation(llama.config, [9, 12, 6], 3), 3)
    want = _steps(
        reference.forward,
        lambda hidden, rows, _: reference.compute_logits(hidden.index_select(0, rows)),
        Conversation(llama.config, [9, 12, 6], 3),
        3,
    )
    for g, w in zip(got, want, strict=True):
        assert g.device == w.device
        torch.testing.assert_close(g, w, rtol=0, atol=0)  # the same kernels on the same values: bit for bit
    assert placed.stats.count > 0


def _cut_edges(placed, engine: str = "cpu") -> dict[tuple[str, str], int]:
    """Per direction, the values read on a platform that holds no current copy: read from the unplaced graph.

    A value has a copy where it was made; a read elsewhere is a cut edge and leaves a copy there; an
    in-place write leaves the written platform's copy the only current one.
    """
    where = dict(placed.assignment)  # the batch's inputs come from the engine's platform, the first loaded
    copies = {name: {placed.cache_platforms.get(name, engine)} for name in placed.graph.input_names}
    found: dict[tuple[str, str], int] = {}
    for node in placed.graph.nodes:
        if node.name not in where:
            continue
        here = where[node.name]
        for value in node.inputs:
            if value.startswith("$"):
                continue
            held = copies.setdefault(value, {where[value[1:].split(".")[0]]} if value.startswith("%") else set())
            if here not in held:
                src = next(iter(held))
                found[(src, here)] = found.get((src, here), 0) + 1
                held.add(here)
        for value in node.mutates:
            copies[value] = {here}
        for value in node.outputs:
            copies[value] = {here}
    return found


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["mlp", "mlp of layer 1 and head", "layer 1 whole (kv on cpu-b)"])
def test_transfers_counted_equal_cut_edges(llama, platforms, policy: str) -> None:
    placed = PlacedModel(llama, POLICIES[policy], platforms)
    decode = placed.graphs["decode"]
    assert decode.cut_edges() == _cut_edges(decode)
    conv = Conversation(llama.config, [5, 7], 1)
    ids, positions, meta = conv.prefill()
    placed.forward(ids, positions, conv.kv_caches, meta)
    ids, positions, meta = conv.decode(0)
    placed.stats.reset()
    placed.logits(placed.forward(ids, positions, conv.kv_caches, meta), torch.arange(2))
    counted = {(s, d): c for (s, d), (c, _) in placed.stats.by_direction.items()}
    assert counted == placed.transfers_per_step("decode")
    # bytes: each transfer of the graph moves its planned bytes per token, two tokens in this step
    graph_bytes = sum(t.bytes_per_token * 2 for t in decode.transfers if t.bytes_per_token)
    head_bytes = sum(t.bytes_per_token * 2 for t in placed.head_transfers() if t.bytes_per_token)
    small = sum(2 * 8 if "i64" in t.shape else 2 * 4 * ids.numel() for t in decode.transfers if not t.bytes_per_token)
    assert placed.stats.bytes <= graph_bytes + head_bytes + small + 4 * meta.block_tables.numel() * 4


def test_mlp_alone_crosses_twice_a_layer(llama, platforms) -> None:
    placed = place(_decode_graph(llama, platforms), MLP_ON_B, platforms)
    on_b = {name for name, p in placed.assignment.items() if p == "cpu-b"}
    assert on_b == {name for name, part in placed.parts.items() if part == "mlp"}
    assert {placed.graph.fx_node(n).target for n in on_b} and len(on_b) == 3 * llama.config.num_layers
    assert placed.cut_edges() == {("cpu", "cpu-b"): 2, ("cpu-b", "cpu"): 2}  # into gate_up, out of down
    assert all(t.bytes_per_token == 4 * llama.config.hidden_size for t in placed.transfers)


@pytest.mark.slow
def test_lm_head_on_one_platform_the_rest_on_the_other(llama, platforms) -> None:
    placed = PlacedModel(llama, {"default": "cpu-b", "rules": [{"platform": "cpu", "part": "lm_head"}]}, platforms)
    assert placed.head_platform == "cpu"
    assert set(placed.graphs["decode"].assignment.values()) == {"cpu-b"}
    assert placed.layer_platforms == ["cpu-b", "cpu-b"]
    assert placed.weights.bytes["cpu"] == llama.lm_head.nelement() * 4
    # the batch comes from the engine's platform (cpu) and the hidden states go back for the head
    assert placed.transfers_per_step("decode") == {("cpu", "cpu-b"): 6, ("cpu-b", "cpu"): 1}


def test_mlps_of_a_layer_range_elsewhere(llama, platforms) -> None:
    placed = place(_decode_graph(llama, platforms), [{"platform": "cpu-b", "part": "mlp", "layers": "1-1"}], platforms)
    for name, platform in placed.assignment.items():
        node = next(n for n in placed.graph.nodes if n.name == name)
        assert (platform == "cpu-b") == (placed.parts[name] == "mlp" and node.layer == 1), name
    text = placed.flat.text()
    assert "cpu-b:b_cpu_linear, layer 1" in text and "cpu-b:b_cpu_linear, layer 0" not in text
    assert text.count("placement.transfer(") == 2


def test_load_many(platforms) -> None:
    from vllm_port.errors import SelectionError

    both = load_many(["cpu", "cpu-b"], plugins="cpu,cpu-b")
    assert list(both) == ["cpu", "cpu-b"] and both.default.platform.name == "cpu"
    assert list(load_many(["auto", "cpu"], plugins="cpu")) == ["cpu"]  # auto picked cpu: loaded once
    with pytest.raises(SelectionError, match="listed twice"):
        load_many(["cpu", "cpu"], plugins="cpu")
    with pytest.raises(SelectionError, match="'cpu-c'"):
        load_many(["cpu", "cpu-c"], plugins="cpu,cpu-b")


def _decode_graph(llama, platforms):
    from vllm_port.flat import apply_passes, trace

    return apply_passes(trace(llama, platforms.default.bind(torch.float32), phase="decode"))


class _Copies(TorchDispatchMode):
    """Every op that copies tensor data (``to``, ``_to_copy``, ``copy_``, ``clone``) with the storages it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[tuple[str, int]] = []
        self.moves = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith(("aten.to.", "aten._to_copy", "aten.copy_", "aten.clone")):
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    self.read.append((name, arg.untyped_storage().data_ptr()))
            self.moves += name.startswith("aten.to.") and bool(kwargs.get("copy"))
        return func(*args, **kwargs)


@pytest.mark.slow
def test_steps_copy_no_weight_and_move_only_cut_edges(llama, platforms) -> None:
    """After placement a step reads weights where they are (none is copied again), moves only the cut edges'
    activations (as many at batch 1 as at batch 4, bytes by the tokens), and runs the CPU-side nodes on the
    providers an unplaced CPU model binds."""
    placed = PlacedModel(llama, [*MLP_ON_B, {"platform": "cpu-b", "part": "lm_head"}], platforms)
    weights = {t.untyped_storage().data_ptr() for t in placed.weights.tensors()}
    per_batch = {}
    for batch in (1, 4):
        conv = Conversation(llama.config, [5] * batch, 1)
        ids, positions, meta = conv.prefill()
        placed.forward(ids, positions, conv.kv_caches, meta)
        ids, positions, meta = conv.decode(0)
        placed.stats.reset()
        with _Copies() as copies, torch.inference_mode():
            placed.logits(placed.forward(ids, positions, conv.kv_caches, meta), torch.arange(batch))
        assert not [name for name, storage in copies.read if storage in weights], "a weight was copied during a step"
        assert copies.moves == placed.stats.count  # every move between platforms is a counted transfer
        per_batch[batch] = placed.stats.to_json()
    assert {d: c["count"] for d, c in per_batch[1].items()} == {d: c["count"] for d, c in per_batch[4].items()}
    assert all(per_batch[4][d]["bytes"] == 4 * per_batch[1][d]["bytes"] for d in per_batch[1])
    unplaced = op_targets(platforms["cpu"].bind(torch.float32))
    flat = placed.graphs["decode"].flat
    for name, platform in placed.graphs["decode"].assignment.items():
        node = next(n for n in flat.nodes if n.name == name)
        if platform == "cpu" and node.kind == "contract":
            assert flat.fx_node(name).target is unplaced[node.op], name


#: A pipeline over two devices of one platform: layer 1 and the LM head on cpu-b's second device.
PIPELINE = [{"platform": "cpu-b:1", "layers": "1-1"}, {"platform": "cpu-b:1", "part": "lm_head"}]


@pytest.mark.slow
def test_pipeline_over_two_devices_of_a_platform(llama, platforms) -> None:
    """Layers split over cpu-b's devices 0 and 1 (one process): the unplaced logits, the cut edges crossing."""
    one = load_many(["cpu-b"], plugins="cpu,cpu-b")  # the engine's batch on cpu-b (device 0)
    placed = PlacedModel(llama, PIPELINE, one)
    assert placed.layer_platforms == ["cpu-b", "cpu-b:1"] and placed.head_platform == "cpu-b:1"
    decode = placed.graphs["decode"]
    layer_of = {n.name: n.layer for n in decode.graph.nodes}
    assert {t for n, t in decode.assignment.items() if layer_of[n] == 1} == {"cpu-b:1"}
    assert decode.cut_edges() == _cut_edges(decode, engine="cpu-b")
    # into layer 1: the hidden state, the residual and the step's metadata; out of it: the hidden state
    assert set(decode.cut_edges()) == {("cpu-b", "cpu-b:1"), ("cpu-b:1", "cpu-b")}
    reference = FlatModel(llama, one["cpu-b"], compile=False)
    got = _steps(placed.forward, placed.logits, Conversation(llama.config, [9, 12, 6], 3), 2)
    want = _steps(
        reference.forward,
        lambda hidden, rows, _: reference.compute_logits(hidden.index_select(0, rows)),
        Conversation(llama.config, [9, 12, 6], 3),
        2,
    )
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert set(placed.stats.to_json()) == {"cpu-b->cpu-b:1", "cpu-b:1->cpu-b"}


@pytest.mark.slow
def test_pipeline_nodes_run_with_their_device_current(llama, platforms, monkeypatch) -> None:
    """On an accelerator, each node of device 1 runs with device 1 current (Triton launches on the current
    device); checked here with device 1 standing for cuda:1 and a recording device module."""
    import contextlib

    one = load_many(["cpu-b"], plugins="cpu,cpu-b")
    placed = PlacedModel(llama, PIPELINE, one)
    decode = placed.graphs["decode"]
    current: list[int] = []
    entered: list[int] = []

    class Recorder:
        @contextlib.contextmanager
        def device(self, index: int):
            current.append(index)
            entered.append(index)
            yield
            current.pop()

    monkeypatch.setattr(torch, "get_device_module", lambda device_type: Recorder())
    decode.devices["cpu-b:1"] = torch.device("cuda", 1)  # as the second GPU would be
    conv = Conversation(llama.config, [5, 7], 1)
    ids, positions, meta = conv.prefill()
    placed.forward(ids, positions, conv.kv_caches, meta)
    ids, positions, meta = conv.decode(0)
    placed.forward(ids, positions, conv.kv_caches, meta)
    on_1 = [n for n, t in decode.assignment.items() if t == "cpu-b:1" and decode.flat.fx_node(n).op == "call_function"]
    assert on_1 and entered == [1] * len(on_1) and current == []
