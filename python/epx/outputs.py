"""What the calls return: named tuples (they also pass through torch.compile)."""

from typing import NamedTuple, Optional

import torch

from .streams import EventOverlap


class Handle(NamedTuple):
    """What a dispatch learned; combine and both backward passes take it.

    ``token`` is a small host int64 tensor that owns the C++ handle (it lives as long as any
    reference to it: autograd's saved tensors, a graph's buffers). The other fields are what the
    Python layer needs: the buffer, the layout, the dispatch's token count, whether combine weighs
    by default, and the router weights (or probs with routing_map) and shared gate autograd differentiates.
    """

    token: torch.Tensor
    buffer_id: int
    layout: int
    tokens: int
    weighted: bool
    weights: Optional[torch.Tensor] = None
    routing_map: Optional[torch.Tensor] = None
    shared_gate: Optional[torch.Tensor] = None  # the dispatch's (shared_expert): combine weighs the shared rows by it

    @property
    def num_rows(self):
        """Rows the layout needs (may exceed capacity_rows); -1 when only on the device (CUDA capacity mode)."""
        return int(self.token[1])

    @property
    def overflow(self):
        """Capacity mode: num_rows > capacity_rows (False where only the device knows: read recv_info)."""
        return bool(self.token[2])

    @property
    def dropped_slots(self):
        """(token, expert) pairs of this rank that capacity_factor dropped."""
        return int(self.token[3])


class DispatchOutput(NamedTuple):
    """Receive rows (N = num_rows, or capacity_rows in capacity mode) and the layout; docs/semantics.md.

    Fields a configuration does not produce are None (recv_scales with wire bf16, recv_weights in
    the rank-major layout, ...). fp8 codes are float8_e4m3fn tensors where torch has that dtype,
    else uint8; NVFP4 codes (two per byte) are uint8.
    """

    recv_x: torch.Tensor
    recv_scales: Optional[torch.Tensor]
    recv_global_scale: Optional[torch.Tensor]
    recv_src: torch.Tensor
    recv_weights: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    expert_offsets: Optional[torch.Tensor]
    tokens_per_expert: Optional[torch.Tensor]
    rank_offsets: Optional[torch.Tensor]
    recv_info: Optional[torch.Tensor]
    handle: Handle
    event: EventOverlap
    # EPLB (num_physical_experts > 0): [T, K] int32, the physical expert chosen for each slot (-1 unused).
    # Last, with a default, so that positional users of the fields above are unaffected.
    topk_physical: Optional[torch.Tensor] = None

    @property
    def num_rows(self):
        return self.handle.num_rows

    @property
    def overflow(self):
        return self.handle.overflow

    @property
    def dropped_slots(self):
        return self.handle.dropped_slots


# The tensor fields of DispatchOutput, in order: the dispatch op returns the token, then these.
DISPATCH_TENSORS = DispatchOutput._fields[:11]


class CombineOutput(NamedTuple):
    out: torch.Tensor  # [T, H] bf16
    overflow: bool  # the dispatch overflowed: rows past capacity contributed nothing
    event: EventOverlap


class DispatchBackwardOutput(NamedTuple):
    grad_x: torch.Tensor  # [T, H] bf16
    grad_topk_weights: Optional[torch.Tensor]  # [T, K] f32 when grad_recv_weights was given
    event: EventOverlap
    grad_shared_gate: Optional[torch.Tensor] = None  # [T] f32, shared_expert with grad_recv_weights


class CombineBackwardOutput(NamedTuple):
    grad_y: torch.Tensor  # [N, H] bf16 in the dispatch layout
    grad_topk_weights: Optional[torch.Tensor]  # [T, K] f32 (weighted only)
    event: EventOverlap
    grad_shared_gate: Optional[torch.Tensor] = None  # [T] f32, weighted with a shared_gate: <grad_out[t], y[t]>
