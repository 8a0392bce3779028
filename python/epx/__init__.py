"""epx for PyTorch: MoE token dispatch and combine between GPUs (docs/python.md).

    import epx
    group = epx.Group.from_torch(torch.distributed.group.WORLD)   # torchrun, one process per GPU
    buffer = epx.Buffer(group, hidden=7168, max_tokens_per_rank=4096, num_experts=256, topk=8)
    d = epx.torch.dispatch(buffer, x, topk_idx, topk_weights)     # autograd-aware
    y = experts(d.recv_x, d.expert_offsets)
    out = epx.torch.combine(buffer, y, d.handle)
"""

# The compiled module may sit in a second portion of this package (a build tree's python/epx/,
# with PYTHONPATH=build/python:python); an installed wheel has it here.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)

try:
    from . import _C
except ImportError as e:  # pragma: no cover - a set-up problem, said plainly
    raise ImportError(
        "epx: the compiled module epx._C is missing or was built for another Python. Build it with the "
        "project's CMake (it goes to build/python/epx; run with PYTHONPATH=build/python:python) or "
        f"`pip install .`; the import said: {e}") from e

from .errors import (ConfigMismatch, Error, ErrorCode, InternalError, InvalidArgument, PeerFailed, Timeout,
                     Unsupported, BY_CODE as _ERRORS_BY_CODE)

_C._set_error_classes({int(code): cls for code, cls in _ERRORS_BY_CODE.items()})

from .config import CapacityMode, Layout, Op, WireFormat  # noqa: E402
from .group import Group  # noqa: E402
from .streams import EventOverlap  # noqa: E402
from .outputs import (CombineBackwardOutput, CombineOutput, DispatchBackwardOutput, DispatchOutput,  # noqa: E402
                      Handle)
from .buffer import Buffer  # noqa: E402
from .low_latency import LowLatencyBuffer, LowLatencyDispatchOutput, LowLatencyHandle  # noqa: E402
from .replay import LayoutRecorder, ReplayError  # noqa: E402
from .all_ranks import combine_all, dispatch_all, ll_combine_all, ll_dispatch_all  # noqa: E402
from . import ops  # noqa: E402  (registers torch.ops.epx.*)
from . import torch  # noqa: E402  (epx.torch: autograd functions; shadows nothing outside this file)

has_cuda = _C.has_cuda


def cuda_available():
    """True when this build has the CUDA backend and a GPU is visible."""
    return _C.cuda_available()


__all__ = [
    "Buffer", "CapacityMode", "CombineBackwardOutput", "CombineOutput", "ConfigMismatch", "DispatchBackwardOutput",
    "DispatchOutput", "Error", "ErrorCode", "EventOverlap", "Group", "Handle", "InternalError", "InvalidArgument",
    "Layout", "LayoutRecorder", "LowLatencyBuffer", "LowLatencyDispatchOutput", "LowLatencyHandle", "Op",
    "PeerFailed", "ReplayError", "Timeout", "Unsupported", "WireFormat", "combine_all", "cuda_available",
    "dispatch_all", "has_cuda", "ll_combine_all", "ll_dispatch_all",
]
