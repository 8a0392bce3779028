"""epx.Group: the ranks that exchange tokens, and the backend that moves them."""

import pickle

import torch

from . import _C
from .errors import Unsupported


class Group:
    """One rank's view of a group. Make them with the static methods below."""

    def __init__(self, c_group):
        self._c = c_group

    @property
    def rank(self):
        return self._c.rank

    @property
    def size(self):
        return self._c.size

    @property
    def backend(self):
        return "cuda" if self._c.backend == 1 else "host"

    @property
    def device(self):
        """torch.device('cpu') on the CPU backend, else the GPU this rank drives."""
        index = self._c.device
        return torch.device("cpu") if index < 0 else torch.device("cuda", index)

    @staticmethod
    def host(ranks):
        """The CPU backend: `ranks` groups, one per rank; drive rank r from its own Python thread (the calls
        release the GIL while they wait for peers)."""
        return [Group(g) for g in _C.host_world(ranks)]

    @staticmethod
    def shared_gpu(ranks, device=0):
        """The shared-GPU test transport: `ranks` ranks on one GPU, one thread each (docs/cuda.md, its limits)."""
        _require_cuda()
        return [Group(g) for g in _C.shared_gpu(ranks, _index(device))]

    @staticmethod
    def cuda(devices=None):
        """One process, one rank per GPU (default: every visible GPU); drive rank r from its own thread."""
        _require_cuda()
        return [Group(g) for g in _C.cuda_world([_index(d) for d in (devices or [])])]

    @staticmethod
    def from_torch(process_group=None, device=None):
        """This process's rank of a torch.distributed process group (any backend: gloo or nccl), one process per
        GPU as torchrun launches it. Collective over the process group: rank 0 makes the NCCL unique id and the
        group carries it to the others. `device`: the GPU of this rank (default: torch's current device).

        Without CUDA (a build without it, or a torch that sees no CUDA device) a process group of one rank is
        the CPU backend's single rank (a rank alone exchanges nothing); more ranks need the CUDA backend (the
        CPU backend's ranks are threads of one process, it has no transport between processes)."""
        import torch.distributed as dist

        pg = process_group if process_group is not None else dist.group.WORLD
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        missing = None if _C.has_cuda else "this build of epx has none (built without nvcc, or with -DEPX_CUDA=OFF)"
        if missing is None and not torch.cuda.is_available():
            missing = "torch sees no CUDA device (a CPU-only torch, or no GPU visible)"
        if size == 1 and missing is not None:
            if device is not None and torch.device(device).type == "cuda":
                raise Unsupported(f"Group.from_torch: device {device} asks for the CUDA backend, and {missing}")
            return Group.host(1)[0]
        if missing is not None:  # every rank of a job has the same build and torch: they refuse alike
            raise Unsupported(f"Group.from_torch: a process group of {size} ranks needs epx's CUDA backend, and "
                              f"{missing}; the CPU backend's ranks are threads of one process (Group.host)")
        index = torch.cuda.current_device() if device is None else _index(device)
        box = [_C.nccl_unique_id() if rank == 0 else None]
        src = _global_rank(pg, 0)
        carrier = torch.device("cuda", index) if dist.get_backend(pg) == "nccl" else None
        dist.broadcast_object_list(box, src=src, group=pg, device=carrier)
        return Group(_C.cuda_group_init_rank(box[0], rank, size, index))

    # --- small host-side collectives (the transport's own all-gather, on every backend) ---------

    def all_gather_bytes(self, record, timeout_ms=0):
        """Every rank's `record` (bytes, at most 1024), in rank order. Collective: every rank calls it at the
        same point of its sequence of collective calls (buffer creations included); it blocks until all have.
        timeout_ms: 0 means EPX_TIMEOUT_MS, else 60 s."""
        return self._c.all_gather(bytes(record), int(timeout_ms))

    def all_gather_object(self, obj, timeout_ms=0):
        """Every rank's picklable `obj` (small: it travels as one all_gather_bytes record), in rank order."""
        return [pickle.loads(r) for r in self.all_gather_bytes(pickle.dumps(obj), timeout_ms)]

    def agree_max(self, value, timeout_ms=0):
        """The largest of every rank's int `value` (collective), so that every rank derives the same number."""
        return max(int(v) for v in self.all_gather_object(int(value), timeout_ms))

    def __repr__(self):
        return f"epx.Group(rank {self.rank} of {self.size}, {self.backend}, {self.device})"


def _require_cuda():
    if not _C.has_cuda:
        raise Unsupported("this build of epx has no CUDA backend (built without nvcc, or with -DEPX_CUDA=OFF)")


def _index(device):
    return device if isinstance(device, int) else torch.device(device).index or 0


def _global_rank(pg, group_rank):
    import torch.distributed as dist

    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(pg, group_rank)
    return dist.distributed_c10d._get_global_rank(pg, group_rank)
