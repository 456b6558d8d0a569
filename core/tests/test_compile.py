"""A flat decoder step of bound ops under torch.compile(fullgraph=True): no graph break, same numbers as eager."""

import torch

import vllm_port
from vllm_port.ops import make_cos_sin_cache


def test_traceable_ops_compile_without_graph_breaks_and_match_eager():
    runtime = vllm_port.load(plugins="cpu")
    eager, traced = runtime.bind(torch.float32), runtime.bind(torch.float32, traceable=True)
    tokens, heads, kv_heads, head, block = 3, 4, 2, 16, 4
    hidden = heads * head
    gen = torch.Generator().manual_seed(0)
    w_norm, w_qkv = (
        torch.randn(hidden, generator=gen),
        torch.randn((heads + 2 * kv_heads) * head, hidden, generator=gen) / 8,
    )
    cos_sin = make_cos_sin_cache(64, head)
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([5, 6, 7], dtype=torch.int32)
    slots = (tables[:, 1].long() * block + (lens.long() - 1 - block)).contiguous()

    def step(kernels, x, positions, key_cache, value_cache):
        h = kernels.rms_norm(x, w_norm, 1e-6)
        q, k, v = kernels.linear(h, w_qkv, None).split([hidden, kv_heads * head, kv_heads * head], dim=-1)
        q, k = q.contiguous(), k.contiguous()
        kernels.rotary_embedding(positions, q, k, head, cos_sin, True)
        kernels.reshape_and_cache(
            k.view(tokens, kv_heads, head), v.reshape(tokens, kv_heads, head), key_cache, value_cache, slots
        )
        return kernels.paged_attention(q.view(tokens, heads, head), key_cache, value_cache, tables, lens, head**-0.5)

    x, positions = torch.randn(tokens, hidden, generator=gen), lens.long() - 1
    caches = torch.randn(2, 6, block, kv_heads, head, generator=gen)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = step(eager, x, positions, *caches.clone())
    torch.testing.assert_close(compiled(traced, x, positions, *caches.clone()), expected)
