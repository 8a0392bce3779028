"""pytest set-up shared by every test file (helpers.py holds the helpers)."""

import os

import pytest
import torch

import epx

# Before CUDA starts (torch starts it lazily): the shared-GPU transport needs every rank's streams
# on their own hardware queues (docs/cuda.md), and the GPU tests poison outputs so that a row the
# kernels never write fails the comparison, as tests/gpu does.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("EPX_POISON_OUTPUTS", "1")
# The shared-GPU tests run torch kernels between epx calls; the first launch of a kernel not loaded
# yet waits for every running kernel, a peer's spinning wait included (docs/cuda.md, "shared GPU"):
# load them all when CUDA starts.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

# Two cores on CI, threads as ranks: torch's own thread pool only gets in the way.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ep1_group():
    """One process, world size 1, over NCCL: torch.distributed carries the unique id (gloo here)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield epx.Group.from_torch(dist.group.WORLD, device=0)
    if started:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def torch_world():
    """torch.distributed's WORLD of one process (gloo over a HashStore): what the adapters are given as the EP
    process group by code that has one (Megatron's tp_ep_group, vLLM's and SGLang's groups)."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if started:
        dist.destroy_process_group()
