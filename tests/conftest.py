"""Session-wide test setup.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module imported), and the first
module to import a kernel can be any test (the engine imports the attention kernels). On a machine
without CUDA every Triton kernel must run in the interpreter, so it is set here, before any test
module is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
