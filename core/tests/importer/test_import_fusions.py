"""An imported model's flat graph gets the fusions the core model of the same checkpoint gets.

The CUDA plugin's graph passes run on CPU here (its Triton providers bound, Triton's interpreter,
as ``plugins/vllm-port-cuda/tests/test_cuda_fusions.py`` does for core models): after core's passes
and the plugin's, the imported graph must fire ``fused_add_rms_norm`` and
``rotary_embedding_and_cache`` as often as the core one and end with the same kernels, node for node.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")  # the CUDA plugin's passes and providers (Triton's CPU interpreter, root conftest.py)
from tiny_models import build_tiny_model, save_tiny_model

import vllm_port
from vllm_port import flat
from vllm_port.flat.graph import op_targets
from vllm_port.flat.passes import PassContext, core_passes, run_passes
from vllm_port.importer import import_model
from vllm_port.models import load_model
from vllm_port.ops import BindContext

#: Fusions whose count must match: the importer emits ``silu_and_mul`` itself (the pass finds none to
#: make), which the comparison of the kernels after the passes covers.
MATCHED_FUSIONS = ("fused_add_rms_norm", "rotary_embedding_and_cache")


def _fused(model, ops, phase: str) -> tuple[dict[str, int], Counter]:
    """Fusions fired and the kernel nodes (contract and plugin ops, by target) after core's and CUDA's passes."""
    from vllm_port_cuda.platform import describe
    from vllm_port_cuda.plugin import vllm_port_graph_passes

    module = flat.trace(model, ops, phase=phase, block_size=4).module
    ctx = PassContext(op_targets(ops), "cuda", torch.float32)
    fired = run_passes(module, ctx, [*core_passes(), *vllm_port_graph_passes(platform=describe())])
    kernels = Counter(
        str(n.target)
        for n in module.graph.nodes
        if n.op == "call_function" and str(n.target).startswith(("vllm_port.", "vllm_port_cuda."))
    )
    return fired, kernels


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_imported_graph_fires_the_fusions_of_the_core_model(cpu_runtime, tmp_path, family):
    cuda_runtime = vllm_port.load(plugins="cpu,cuda")
    ops = cuda_runtime.registry.bind(BindContext("cuda", "cuda", torch.float32, {}))
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
