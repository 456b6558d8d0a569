"""An imported model's flat graph gets the fusions the core model of the same checkpoint gets.

The CUDA plugin's graph passes run on CPU here (its Triton providers bound, Triton's interpreter,
as ``plugins/vllm-port-cuda/tests/test_cuda_fusions.py`` does for core models): after core's passes
and the plugin's, the imported graph must fire ``fused_add_rms_norm`` and
``rotary_embedding_and_cache`` as often as the core one and end with the same kernels, node for node.
Phi-3 and Gemma-2 have no core model: their counts are derived from the architecture (below), and the
fused graph, run in Triton's interpreter, gives ``transformers``' logits.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")  # the CUDA plugin's passes and providers (Triton's CPU interpreter, root conftest.py)
from paged_harness import Conversation, assert_fp32_close
from tiny_models import build_tiny_model, save_tiny_model

import vllm_port
from vllm_port import flat
from vllm_port.flat.flat_graph import op_targets
from vllm_port.flat.passes import PassContext, core_passes, run_passes
from vllm_port.importer import import_model
from vllm_port.models import load_model
from vllm_port.ops import BindContext

#: Fusions whose count must match: the importer emits ``silu_and_mul`` itself (the pass finds none to
#: make), which the comparison of the kernels after the passes covers.
MATCHED_FUSIONS = ("fused_add_rms_norm", "rotary_embedding_and_cache")


def _fused_graph(model, ops, phase: str) -> tuple[dict[str, int], flat.FlatGraph]:
    """Fusions fired and the flat graph after core's and CUDA's passes."""
    from vllm_port_cuda.platform import describe
    from vllm_port_cuda.plugin import vllm_port_graph_passes

    graph = flat.trace(model, ops, phase=phase, block_size=4)
    module = graph.module
    ctx = PassContext(op_targets(ops), "cuda", torch.float32)
    fired = run_passes(module, ctx, [*core_passes(), *vllm_port_graph_passes(platform=describe())])
    return fired, graph.with_module(module, fired)


def _fused(model, ops, phase: str) -> tuple[dict[str, int], Counter]:
    """Fusions fired and the kernel nodes (contract and plugin ops, by target) after core's and CUDA's passes."""
    fired, graph = _fused_graph(model, ops, phase)
    kernels = Counter(
        str(n.target)
        for n in graph.module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith(("vllm_port.", "vllm_port_cuda."))
    )
    return fired, kernels


def _cuda_ops():
    return vllm_port.load(plugins="cpu,cuda").registry.bind(BindContext("cuda", "cuda", torch.float32, {}))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_imported_graph_fires_the_fusions_of_the_core_model(cpu_runtime, tmp_path, family):
    ops = _cuda_ops()
    core = load_model(save_tiny_model(family, tmp_path / family), torch.device("cpu"), torch.float32)
    imported = import_model(build_tiny_model(family), cpu_runtime)
    layers = core.config.num_layers
    for phase in flat.PHASES:
        core_fired, core_kernels = _fused(core, ops, phase)
        fired, kernels = _fused(imported, ops, phase)
        assert {f: fired[f] for f in MATCHED_FUSIONS} == {f: core_fired[f] for f in MATCHED_FUSIONS}
        # every residual add but the first goes into the next norm; every layer's rotary into its cache write
        assert fired["fused_add_rms_norm"] == 2 * layers and fired["rotary_embedding_and_cache"] == layers
        assert kernels == core_kernels, phase


#: Per layer ``L`` of the importer-only families, after core's and CUDA's passes (``rms_norm`` counted in
#: the whole graph). Phi-3 is Llama's layer with q/k/v and gate/up stored fused: ``h = x + o(attn(n1(x)))``,
#: ``y = h + down(mlp(n2(h)))``; the attention add feeds ``n2`` and the MLP add the next layer's ``n1``
#: (the last one the final norm), so 2 ``fused_add_rms_norm`` per layer, and only layer 0's ``n1`` (over
#: the embedding, no add) stays ``rms_norm``. Its q and k are slices of ``qkv_proj``, carried as
#: pieces of one split of its rows (``_rows``), so each layer's rotary fuses with its cache write.
#: Gemma-2 norms after attention and MLP too: ``h = x + post_attn(attn(input(x)))``,
#: ``y = h + post_ff(mlp(pre_ff(h)))``; each add feeds a pre-norm (``pre_ff``, the next ``input`` or the
#: final norm): 2 fused per layer. The post-norms read projections, not adds, and stay ``rms_norm``
#: (2 per layer), as does layer 0's input norm over the scaled embedding: ``2 L + 1``. Its q/k/v
#: projections are fused by the importer into one split, as Llama's: one rotary/cache fusion per layer.
IMPORT_ONLY_FUSIONS = {
    "phi3": lambda layers: {"fused_add_rms_norm": 2 * layers, "rotary_embedding_and_cache": layers, "rms_norm": 1},
    "gemma2": lambda layers: {
        "fused_add_rms_norm": 2 * layers,
        "rotary_embedding_and_cache": layers,
        "rms_norm": 2 * layers + 1,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_importer_only_families_fire_the_fusions_their_architecture_allows(cpu_runtime, family):
    hf = build_tiny_model(family)
    imported = import_model(hf, cpu_runtime)
    config = imported.config
    want = IMPORT_ONLY_FUSIONS[family](config.num_layers)
    ops = _cuda_ops()
    graphs = {}
    for phase in flat.PHASES:
        fired, graphs[phase] = _fused_graph(imported, ops, phase)
        assert {f: fired[f] for f in MATCHED_FUSIONS} == {f: want[f] for f in MATCHED_FUSIONS}, phase
        counts = Counter(node.op for node in graphs[phase])
        assert counts["rms_norm"] == want["rms_norm"], phase
        assert not {"rotary_embedding", "reshape_and_cache"} & set(counts), phase  # every pair fused
    # the fused graph computes the model: Triton's interpreter against transformers, prefill then decode
    talk = Conversation(config, [9, 14], decode_steps=2)  # 14 tokens: past Gemma-2's window of 8
    with torch.no_grad():
        want_logits = [hf(s[None]).logits[0] for s in talk.seqs]
    ids, pos, meta = talk.prefill()
    hidden = graphs["prefill"](*flat.graph_inputs(ids, pos, talk.kv_caches, meta))
    prompts = zip(want_logits, talk.prompts, strict=True)
    assert_fp32_close(imported.compute_logits(ops, hidden), torch.cat([w[:n] for w, n in prompts]))
    for step in range(2):
        ids, pos, meta = talk.decode(step)
        hidden = graphs["decode"](*flat.graph_inputs(ids, pos, talk.kv_caches, meta))
        expected = torch.stack([w[n + step] for w, n in zip(want_logits, talk.prompts, strict=True)])
        assert_fp32_close(imported.compute_logits(ops, hidden), expected)
