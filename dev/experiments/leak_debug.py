"""What a closed captured engine leaves in reference cycles on the GPU (issue 30's leak test found 5.8 MB that
gc.collect() frees): the garbage's CUDA tensors and the objects that hold them."""

import collections
import gc
import sys
import tempfile
import weakref
from pathlib import Path

import torch

sys.path.insert(0, "core/tests/engine")
from test_engine_gpu import write_checkpoint

import vllm_port
from vllm_port import LLM, SamplingParams

model_dir = write_checkpoint(Path(tempfile.mkdtemp()))
gen = torch.Generator().manual_seed(1)
batch = [torch.randint(5, 512, (n,), generator=gen).tolist() for n in (9, 40, 17, 3, 25)]
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
runtime = vllm_port.load(plugins="cuda")
gc.collect()
gc.disable()
llm = LLM(str(model_dir), device=runtime, kv_cache_memory=8 << 20, max_num_batched_tokens=32)
llm.generate(batch, params)
runner = weakref.ref(llm.runner)
llm.close()
del llm
torch.accelerator.synchronize()
print("runner alive:", runner() is not None)
gc.set_debug(gc.DEBUG_SAVEALL)
found = gc.collect()
garbage = list(gc.garbage)
cuda = [o for o in garbage if type(o) is torch.Tensor and o.is_cuda]
fake = collections.Counter(
    type(o).__qualname__ for o in garbage if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor
)
print("tensor subclasses in garbage:", fake)
print(f"garbage: {found} objects, {len(cuda)} CUDA tensors, {sum(t.untyped_storage().nbytes() for t in cuda):,} bytes")
print("types:", collections.Counter(type(o).__qualname__ for o in garbage).most_common(40))
ids = {id(o) for o in garbage}
for t in sorted(cuda, key=lambda t: -t.untyped_storage().nbytes())[:14]:
    holders = [o for o in gc.get_referrers(t) if id(o) in ids]
    names = []
    for h in holders[:4]:
        if isinstance(h, dict):
            owners = [type(o).__qualname__ for o in gc.get_referrers(h) if id(o) in ids][:3]
            keys = [k for k, v in h.items() if v is t][:3]
            names.append(f"dict{keys} of {owners}")
        elif isinstance(h, (list, tuple)):
            owners = [type(o).__qualname__ for o in gc.get_referrers(h) if id(o) in ids][:3]
            names.append(f"{type(h).__name__}[{len(h)}] in {owners}")
        else:
            names.append(type(h).__qualname__)
    print(f"  {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes():,} B, held by {names}")
cells = [o for o in garbage if type(o).__name__ == "cell"]
funcs = [o for o in garbage if type(o).__name__ == "function"]
print("functions in garbage:", [f"{f.__module__}.{f.__qualname__}" for f in funcs][:30])
