"""What every test run of this repository needs before any test module is imported.

Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before the first
``@triton.jit`` function is made: any test module may import a plugin that defines kernels (the CUDA
plugin's fusions), so the choice is made here, not in the Triton tests' own conftest.
"""

import os

import torch

if not torch.accelerator.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
