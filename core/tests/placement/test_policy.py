"""Policies as written (mapping, TOML, JSON) and every way one can be wrong: each error names the rule, the value
and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_port.placement import PlacedModel, PlacementError, PlacementPolicy, load_policy, place

TOML = """
default = "cpu"

[[rules]]
label = "mlps of the upper half"
platform = "cpu-b"
part = "mlp"
layers = "1-1"

[[rules]]
platform = "cpu-b"
op = ["linear"]
weight = "lm_head"
"""


def test_toml_json_and_mapping_read_the_same(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(TOML)
    from_toml = PlacementPolicy.from_file(tmp_path / "p.toml")
    (tmp_path / "p.json").write_text(json.dumps(from_toml.to_json()))
    from_json = load_policy(str(tmp_path / "p.json"))
    from_mapping = PlacementPolicy.parse(from_toml.to_json())
    assert from_toml.rules[0].layers == (1, 1) and from_toml.rules[0].label == "mlps of the upper half"
    assert from_toml.to_json() == from_json.to_json() == from_mapping.to_json()
    assert from_toml.platforms() == ["cpu", "cpu-b"]
    rule = from_toml.rules[1]
    assert rule.matches("linear", "lm_head", None, "lm_head", ["lm_head"])
    assert not rule.matches("linear", "attention", 0, "linear", ["layers.0.qkv_weight"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"rules": [{"platform": "cpu", "op": "matmul"}]}, r"placement rule 0: op 'matmul' is neither a contract op"),
        ({"rules": [{"platform": "cpu", "op": "aten.nonsense.default"}]}, r"op 'aten.nonsense.default'"),
        ({"rules": [{"platform": "cpu", "part": "ffn"}]}, r"part 'ffn' is not one of embedding, attention, mlp"),
        ({"rules": [{"platform": "cpu", "layers": "3-1"}]}, r"layers '3-1' is not a layer range; write 'FIRST-LAST'"),
        ({"rules": [{"platform": "cpu", "layers": "x"}]}, r"layers 'x' is not a layer range"),
        ({"rules": [{"platform": "cpu", "layers": [-1, 2]}]}, r"layers \[-1, 2\] is not a layer range"),
        ({"rules": [{"platform": "cpu", "layers": True}]}, r"layers True is not a layer range"),
        ({"rules": [{"part": "mlp"}]}, r"placement rule 0: platform is None; every rule names a platform"),
        (
            {"rules": [{"platform": "cpu", "label": "x", "parts": "mlp"}]},
            r"rule 0 \('x'\): unknown key\(s\) \['parts'\]",
        ),
        ({"rule": []}, r"unknown key\(s\) \['rule'\]; a policy holds default, rules"),
        ({"rules": [{"platform": "cuda:x"}]}, r"platform 'cuda:x' is not NAME or NAME:INDEX"),
        ({"rules": [{"platform": "cpu", "node": []}]}, r"node is \[\]; give a non-empty string"),
        ({"default": 3}, r"default is 3; give a platform name"),
        ("cpu", r"is not a policy"),
    ],
)
def test_bad_policies_are_refused(spec, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        PlacementPolicy.parse(spec)


def test_malformed_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "bad.toml").write_text("[[rules]]\nplatform = \n")
    with pytest.raises(PlacementError, match=r"bad.toml: not valid TOML: .*line 2.*fix the file"):
        PlacementPolicy.from_file(tmp_path / "bad.toml")
    (tmp_path / "bad.json").write_text('{"rules": [}')
    with pytest.raises(PlacementError, match=r"bad.json: not valid JSON: .* at line 1 column 12"):
        load_policy(tmp_path / "bad.json")
    with pytest.raises(PlacementError, match=r"missing.toml: cannot be read"):
        load_policy(str(tmp_path / "missing.toml"))
    (tmp_path / "rule.toml").write_text('[[rules]]\nplatform = "cpu"\npart = "mlps"\n')
    with pytest.raises(PlacementError, match=r"placement rule 0 of .*rule.toml: part 'mlps'"):
        load_policy(tmp_path / "rule.toml")


def _graph(llama, platforms):
    from vllm_port.flat import apply_passes, trace

    return apply_passes(trace(llama, platforms.default.bind(torch.float32), phase="decode"))


@pytest.mark.slow
def test_placing_refuses_what_cannot_run(llama, platforms) -> None:
    graph = _graph(llama, platforms)
    with pytest.raises(
        PlacementError, match=r"rule 0: platform 'cuda' is not loaded \(loaded: cpu, cpu-b\); load it too"
    ):
        place(graph, [{"platform": "cuda", "part": "mlp"}], platforms)
    with pytest.raises(PlacementError, match=r"default platform 'npu' is not loaded"):
        place(graph, {"default": "npu"}, platforms)
    with pytest.raises(PlacementError, match=r"rule 0: layers 1-5 reach past the model's 2 layers \(0-1\)"):
        place(graph, [{"platform": "cpu-b", "layers": "1-5"}], platforms)
    with pytest.raises(
        PlacementError, match=r"rule 0: platform 'cpu-b:2': 'cpu-b' has 2 device\(s\) here \(indices 0-1\)"
    ):
        place(graph, [{"platform": "cpu-b:2", "layers": "1"}], platforms)
    with pytest.raises(PlacementError, match=r"default 'cpu:1': platform 'cpu' has 1 device\(s\) here"):
        place(graph, {"default": "cpu:1"}, platforms)
    split = [{"platform": "cpu-b", "op": "paged_attention", "layers": "1", "label": "attention only"}]
    with pytest.raises(PlacementError) as caught:
        place(graph, split, platforms)
    text = str(caught.value)
    assert "layer 1's KV cache is read and written by nodes on different platforms" in text
    assert "reshape_and_cache_1 on 'cpu' (the default)" in text
    assert "paged_attention_1 on 'cpu-b' (placement rule 0 ('attention only'))" in text
    assert "part = 'attention', layers = '1'" in text


@pytest.mark.slow
def test_phases_must_agree_on_the_kv_cache(llama, platforms) -> None:
    from vllm_port.flat import trace

    decode = place(_graph(llama, platforms), [{"platform": "cpu-b", "part": "attention", "layers": "1"}], platforms)
    assert decode.cache_platforms == {
        "k_cache_0": "cpu",
        "v_cache_0": "cpu",
        "k_cache_1": "cpu-b",
        "v_cache_1": "cpu-b",
    }
    prefill = trace(llama, platforms.default.bind(torch.float32), phase="prefill")
    with pytest.raises(PlacementError, match=r"k_cache_1 is on 'cpu-b' for one phase and on 'cpu' for the prefill"):
        place(prefill, [], platforms, cache_platforms=decode.cache_platforms)


@pytest.mark.slow
def test_a_weight_budget_is_kept_before_anything_moves(llama, platforms) -> None:
    with pytest.raises(PlacementError, match=r"platform 'cpu': weight .* over its budget of 1,000; place more"):
        PlacedModel(llama, [], platforms, budgets={"cpu": 1000})
    head = llama.lm_head.nelement() * 4
    placed = PlacedModel(
        llama, [{"platform": "cpu-b", "part": ["mlp", "lm_head"]}], platforms, budgets={"cpu-b": 10**9}
    )
    mlp = sum(t.nelement() * 4 for layer in llama.layers for t in (layer.gate_up_weight, layer.down_weight))
    assert placed.weights.bytes["cpu-b"] == mlp + head
