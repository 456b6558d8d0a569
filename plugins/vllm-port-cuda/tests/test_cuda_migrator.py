"""The CUDA plugin's migrator: core's FusedSwapMigrator, served for the cuda platform only."""

from __future__ import annotations

import dataclasses

from vllm_port.kernels.swap_migrator import FusedSwapMigrator
from vllm_port_cuda import plugin
from vllm_port_cuda.platform import describe


def test_the_cuda_platform_swaps_small_swaps_in_one_kernel() -> None:
    migrator = plugin.vllm_port_migrator(platform=describe())
    assert isinstance(migrator, FusedSwapMigrator) and migrator.kernel_below_bytes == 64 << 20
    assert plugin.vllm_port_migrator(platform=dataclasses.replace(describe(), name="rocm")) is None
