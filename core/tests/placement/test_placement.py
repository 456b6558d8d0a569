"""A placed model computes what the unplaced one does, with the transfers its policy cuts, and no others."""

from __future__ import annotations

import pytest
import torch
from paged_harness import Conversation

from vllm_port.flat import FlatModel
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


def _cut_edges(placed) -> dict[tuple[str, str], int]:
    """Per direction, the values read on a platform that holds no current copy: read from the unplaced graph.

    A value has a copy where it was made; a read elsewhere is a cut edge and leaves a copy there; an
    in-place write leaves the written platform's copy the only current one.
    """
    where = dict(placed.assignment)
    engine = "cpu"  # the batch's inputs come from the engine's platform, the first loaded
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
