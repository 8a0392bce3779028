"""The handles DeepEP's calls return: tuples with DeepEP's fields, plus the epx state they stand for.

Code written for DeepEP unpacks them (``rank_prefix_matrix = handle[0]``, ``src_info, layout_range,
num_max_dispatch_tokens_per_rank, hidden, num_experts = handle``), so they are tuples with DeepEP's
fields in DeepEP's order. Fields epx does not compute are None (DeepEP's channel bookkeeping); the
epx handle and buffer travel as attributes, so keep passing the object a call returned (a copy made
with ``tuple(handle)`` has lost them and is refused).
"""

from typing import NamedTuple, Optional

import torch


class _DispatchFields(NamedTuple):
    rank_prefix_matrix: torch.Tensor  # [R, R] int32: column `rank` exact, the rest -1 (not exchanged)
    channel_prefix_matrix: Optional[torch.Tensor]  # DeepEP's channels: None
    recv_channel_prefix_matrix: Optional[torch.Tensor]  # None
    recv_src_idx: torch.Tensor  # [N] int32: the source token of each received row (-1 padding)
    is_token_in_rank: torch.Tensor  # [T, R] bool
    send_head: Optional[torch.Tensor]  # DeepEP's ring positions: None


class DispatchHandle(_DispatchFields):
    """The handle of a high-throughput dispatch (DeepEP's 6-tuple). Attributes: ``epx`` (the epx.Handle),
    ``buffer`` (the epx.Buffer that made it), ``recv_topk_idx`` ([N, K] int32, local ids or -1) and
    ``recv_topk_weights`` with the version it had when returned (combine trusts it unchanged)."""

    def attach(self, epx_handle, buffer, recv_topk_idx, recv_topk_weights):
        self.epx, self.buffer = epx_handle, buffer
        self.recv_topk_idx, self.recv_topk_weights = recv_topk_idx, recv_topk_weights
        self.weights_version = None if recv_topk_weights is None else recv_topk_weights._version
        return self


class _LowLatencyFields(NamedTuple):
    src_info: torch.Tensor  # [L, R*M] int32: the source token of each received row
    layout_range: torch.Tensor  # [L, R] int64: (first row << 32) | rows, per source rank
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int


class LowLatencyHandle(_LowLatencyFields):
    """The handle of a low-latency dispatch (DeepEP's 5-tuple). Attributes: ``epx`` (the
    epx.LowLatencyHandle, None until a hook has run) and ``buffer`` (the epx.LowLatencyBuffer)."""

    def attach(self, epx_handle, buffer):
        self.epx, self.buffer = epx_handle, buffer
        return self


def is_dispatch_handle(handle):
    return isinstance(handle, DispatchHandle) and hasattr(handle, "epx")


def is_low_latency_handle(handle):
    return isinstance(handle, LowLatencyHandle) and hasattr(handle, "buffer")
