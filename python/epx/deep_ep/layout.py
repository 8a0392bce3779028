"""Plain-torch pieces of DeepEP's outputs that epx does not return in DeepEP's form."""

import torch

from ..streams import EventOverlap, tensors_in


def dispatch_layout(topk_idx, num_experts, num_ranks):
    """DeepEP's get_dispatch_layout: tokens per rank [R] int32, per expert [E] int32, is_token_in_rank [T, R]
    bool. Scatters instead of bincount / nonzero so nothing waits for the host (CUDA graphs)."""
    local = num_experts // num_ranks
    used = topk_idx >= 0
    ranks = torch.where(used, topk_idx // local, torch.full_like(topk_idx, num_ranks))
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx.device)
    in_rank.scatter_(1, ranks, True)  # column R collects the unused slots
    in_rank = in_rank[:, :num_ranks].contiguous()
    experts = torch.where(used, topk_idx, torch.full_like(topk_idx, num_experts)).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int32, device=topk_idx.device)
    per_expert.scatter_add_(0, experts, torch.ones_like(experts, dtype=torch.int32))
    return in_rank.sum(dim=0, dtype=torch.int32), per_expert[:num_experts].contiguous(), in_rank


def aligned_counts(tokens_per_expert, alignment):
    """num_recv_tokens_per_expert_list: each local expert's received count rounded up to `alignment`."""
    return [-(-int(c) // alignment) * alignment for c in tokens_per_expert.tolist()]


def rank_prefix_matrix(rank_offsets, rank, num_ranks):
    """[R, R] int32 with column `rank` = tokens received from ranks 0..i (what this rank knows); the other
    columns are what the other ranks received, which epx does not exchange: -1."""
    matrix = torch.full((num_ranks, num_ranks), -1, dtype=torch.int32, device=rank_offsets.device)
    matrix[:, rank] = rank_offsets[1:].to(torch.int32)
    return matrix


def column_major(t):
    """The same values with the last two dimensions column-major (DeepEP's low-latency scale layout, for
    TMA): strides (.., 1, rows)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def ue8m0_packed(scales):
    """Power-of-two f32 scales [..., G] as DeepEP's packed UE8M0: the exponent byte of each, four to an
    int32 (block 4j + b in byte b, little-endian), [..., G / 4] int32."""
    exponents = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    return exponents.to(torch.uint8).view(torch.int32)


def layout_range(recv_layout):
    """DeepEP's layout_range [L, R] int64 = (first row << 32) | rows from epx's recv_layout [L, R, 2] int32."""
    first, rows = recv_layout[..., 0].to(torch.int64), recv_layout[..., 1].to(torch.int64)
    return (first << 32) | rows


def finish_on(buffer, event, make):
    """Runs make() where a call of epx buffer `buffer` left its outputs and returns (its result, the event
    to give back).

    An asynchronous call (event.event set) left them on the buffer's comm stream: make() runs there too
    and the returned event is recorded after it; its new tensors are record_stream'ed on the current
    stream, which uses them next. Otherwise the current stream already waited: run it here."""
    if event.event is None:
        return make(), event
    stream, current = buffer.comm_stream, torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        result = make()
        done = torch.cuda.Event()
        done.record(stream)
    for t in tensors_in(result):
        if t.is_cuda:
            t.record_stream(current)
    return result, EventOverlap(done, event.extra_tensors)
