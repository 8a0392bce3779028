"""pytest set-up shared by every test file (helpers.py holds the helpers)."""

import os

import torch

# Before CUDA starts (torch starts it lazily): the shared-GPU transport needs every rank's streams
# on their own hardware queues (docs/cuda.md), and the GPU tests poison outputs so that a row the
# kernels never write fails the comparison, as tests/gpu does.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("EPX_POISON_OUTPUTS", "1")

# Two cores on CI, threads as ranks: torch's own thread pool only gets in the way.
torch.set_num_threads(1)
