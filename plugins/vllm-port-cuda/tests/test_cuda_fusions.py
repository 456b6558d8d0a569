"""The CUDA plugin's fusion of rotary embedding and the KV-cache write, checked in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # runs in Triton's CPU interpreter without a GPU (the root conftest.py)

import vllm_port
from vllm_port import flat
from vllm_port.flat.flat_graph import op_targets
from vllm_port.flat.passes import PassContext, core_passes, run_passes
from vllm_port.ops import BindContext, make_cos_sin_cache, reshape_and_cache, rotary_embedding
from vllm_port_cuda import fusions
from vllm_port_cuda.platform import describe
from vllm_port_cuda.plugin import vllm_port_graph_passes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("is_neox", "rot"), [(True, 64), (False, 64), (True, 32)], ids=["neox", "gptj", "partial"])
def test_fused_kernel_equals_rotary_then_cache_write(dtype, is_neox, rot):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head, blocks, block = 5, 4, 2, 64, 6, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)  # strided views, as a model has
    caches = [torch.randn(blocks, block, kv_heads, head, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    positions = torch.tensor([3, 0, 17, 5, 9], device=DEVICE)
    slots = torch.tensor([2, -1, 9, 22, 13], device=DEVICE)  # token 1 is padding: written nowhere
    cos_sin = make_cos_sin_cache(64, rot).to(DEVICE)
    want_qkv, want_caches = qkv.clone(), [c.clone() for c in caches]
    wq, wk, wv = want_qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    rotary_embedding.reference(positions, wq, wk, head, cos_sin, is_neox)
    reshape_and_cache.reference(
        wk.unflatten(-1, (kv_heads, head)), wv.unflatten(-1, (kv_heads, head)), *want_caches, slots
    )
    fusions.rotary_embedding_and_cache(
        positions, q, k, v.unflatten(-1, (kv_heads, head)), *caches, slots, head, cos_sin, is_neox
    )
    tol = rotary_embedding.tolerances[dtype]
    torch.testing.assert_close(qkv, want_qkv, atol=tol.atol, rtol=tol.rtol)
    for got, want in zip(caches, want_caches, strict=True):
        torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.slow
def test_pass_fuses_each_layer_of_a_model_bound_to_the_triton_providers(tmp_path):
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "core" / "tests" / "models"))
    from tiny_models import save_tiny_model

    from vllm_port.models import load_model

    model = load_model(save_tiny_model("qwen2", tmp_path), torch.device("cpu"), torch.float32)
    runtime = vllm_port.load(plugins="cpu,cuda")
    triton_ops = runtime.registry.bind(BindContext("cuda", "cuda", torch.float32, {}))
    (fusion,) = vllm_port_graph_passes(platform=describe())
    for phase in flat.PHASES:
        graph = flat.trace(model, triton_ops, phase=phase, block_size=4)
        module = graph.module
        ctx = PassContext(op_targets(triton_ops), "cuda", torch.float32)
        fired = run_passes(module, ctx, [*core_passes(), fusion])
        assert fired["rotary_embedding_and_cache"] == model.config.num_layers
        fused = graph.with_module(module, fired)
        plugin_nodes = [n for n in fused if n.kind == "plugin"]
        assert [n.plugin for n in plugin_nodes] == ["vllm_port_cuda"] * model.config.num_layers
        assert not {"rotary_embedding", "reshape_and_cache"} & {n.op for n in fused}
    # where another provider serves rotary (forced for debugging), the pass leaves the graph alone
    mixed = runtime.registry.bind(BindContext("cuda", "cuda", torch.float32, {}), {"rotary_embedding": "reference"})
    module = flat.trace(model, mixed, phase="decode").module
    assert run_passes(module, PassContext(op_targets(mixed), "cuda", torch.float32), [fusion]) == {
        "rotary_embedding_and_cache": 0
    }
