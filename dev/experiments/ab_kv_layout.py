"""``vllm-port bench engine`` on the CPU platform with its KV cache head-major (its default) or token-major.

    .venv/bin/python dev/experiments/ab_kv_layout.py --dtype bfloat16 --systems engine [bench engine's flags]
    HEAD_MAJOR=0 .venv/bin/python dev/experiments/ab_kv_layout.py ...    # the contract's layout, stored as seen

``HEAD_MAJOR=0`` replaces the CPU platform's description with one whose ``kv_head_major`` is False before the engine
starts, so the same command measures both layouts (run them alternating: the machine is shared).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import vllm_port_cpu.platform
import vllm_port_cpu.plugin
from vllm_port.cli import main

if __name__ == "__main__":
    if os.environ.get("HEAD_MAJOR") == "0":
        described = vllm_port_cpu.platform.describe

        def token_major() -> vllm_port_cpu.platform.PlatformDescription:
            return dataclasses.replace(described(), kv_head_major=False)

        vllm_port_cpu.plugin.describe = vllm_port_cpu.platform.describe = token_major
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
