"""The CUDA target's prefill kernel compiled for sm_90 without a GPU (``dev/sm90_stats.py``): what Hopper runs.

Triton's wheel compiles for any NVIDIA target offline, so CI checks the Hopper path's premises on every run:
the key and value tiles come through TMA, the products through ``wgmma``, and two programs fit one SM (the
CUDA target's tiles were chosen for that: docs/results/attention-h200.md). The CUDA plugin's Hopper prefill
(``vllm_port_cuda.hopper_prefill``, Gluon, what sm_90 runs) must keep its FlashAttention-3 schedule: a product
left in flight under the softmax (``wgmma.wait_group 1``), registers handed from the producer warp to the
consumers (``setmaxnreg``), no CTA-wide barrier, no spills. So must the first Gluon experiment
(``dev/experiments/gluon_prefill.py``, not shipped). The compile runs in a child
process without ``TRITON_INTERPRET`` (the interpreter's kernels are Python, which the compiler cannot take).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia")

SCRIPT = Path(__file__).resolve().parents[3] / "dev" / "sm90_stats.py"


@pytest.mark.slow
def test_the_hopper_kernels_use_tma_and_wgmma_as_designed():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--json"], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "cuobjdump" in done.stderr + done.stdout:  # a Triton wheel without NVIDIA's tools
        pytest.skip(f"cannot inspect an sm_90 binary here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    stats = report["shipped"]
    assert stats["tiles"] == [128, 64, 4, 2]
    assert stats["tma_loads"] > 0 and stats["wgmma"] > 0, stats
    assert stats["programs_per_sm"] >= 2, stats
    # the Hopper kernel: FA3's overlap, warp-specialised, its warpgroups never waiting for each other at a bar.sync
    hopper = report["hopper"]
    assert 1 in hopper["waits"] and hopper["spill_stores"] == 0 and hopper["tma_loads"] > 0, hopper
    assert hopper["register_handoffs"] > 0 and hopper["cta_barriers"] == 0, hopper
    # 16-token blocks: eight TMA boxes a key tile (four times the loads), still without spilling
    block16 = report["hopper_block16"]
    assert block16["tma_loads"] > hopper["tma_loads"] and block16["spill_stores"] == 0, block16
    assert 1 in block16["waits"] and block16["register_handoffs"] > 0 and block16["cta_barriers"] == 0, block16
    # the Gluon experiment (dev/experiments/gluon_prefill.py) keeps one product in flight under the softmax, without spilling
    gluon = report["gluon"]
    assert 1 in gluon["waits"] and gluon["spill_stores"] == 0 and gluon["tma_loads"] > 0, gluon
