"""Cached dispatch (Buffer.dispatch with a handle): new rows in the layout of the handle's dispatch,
bit for bit what a dispatch of those rows with the same routing returns; refusals fail every rank."""

import pytest
import torch

import epx
from helpers import Problem, make_buffers, random_bf16, run_all, run_ranks

P = Problem(2, 256, 8, 3, 12, seed=21, unused=0.2)


def _same(a, b):
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("wire", ["bf16", "fp8", "fp8_ue8m0", "nvfp4"])
@pytest.mark.parametrize("layout", ["expert_major", "rank_major"])
def test_cached_dispatch_matches_a_dispatch_of_the_new_rows(wire, layout):
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=256, max_tokens_per_rank=12, num_experts=8, topk=3, wire=wire,
                           expert_alignment=4)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        first = b.dispatch(P.x[r], P.idx[r], P.w[r], layout=layout)
        fresh = random_bf16((P.tokens[r], 256), 100 + r)
        cached = b.dispatch(fresh, handle=first.handle)
        again = b.dispatch(fresh, P.idx[r], P.w[r], layout=layout)  # the same routing, a full dispatch
        return first, cached, again

    for first, cached, again in run_all(groups, rank):
        assert cached.handle is first.handle
        for field in ("recv_x", "recv_scales", "recv_global_scale"):
            assert _same(getattr(cached, field), getattr(again, field)), field
        assert not _same(cached.recv_x, first.recv_x)  # new rows, not the first dispatch's
        assert cached.recv_src is None and cached.expert_offsets is None and cached.recv_info is None


def test_cached_dispatch_of_prequantized_fp8():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=256, max_tokens_per_rank=12, num_experts=8, topk=3, wire="fp8")

    def rank(g):
        b, r = buffers[g.rank], g.rank
        first = b.dispatch(P.x[r], P.idx[r], P.w[r])
        codes, scales = first.recv_x[:P.tokens[r]].contiguous(), first.recv_scales[:P.tokens[r]].contiguous()
        cached = b.dispatch(codes, x_scales=scales, handle=first.handle)
        again = b.dispatch(codes, P.idx[r], P.w[r], x_scales=scales)
        return cached, again

    for cached, again in run_all(groups, rank):
        assert _same(cached.recv_x, again.recv_x) and _same(cached.recv_scales, again.recv_scales)


@pytest.mark.parametrize("case", ["routing", "layout", "tokens", "other buffer"])
def test_cached_dispatch_refusals_fail_every_rank(case):
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=256, max_tokens_per_rank=12, num_experts=8, topk=3)
    others = make_buffers(groups, hidden=256, max_tokens_per_rank=12, num_experts=8, topk=3)

    def rank(g):
        b, r = buffers[g.rank], g.rank
        d = b.dispatch(P.x[r], P.idx[r], P.w[r])
        handle = others[r].dispatch(P.x[r], P.idx[r], P.w[r]).handle if case == "other buffer" else d.handle
        if r == 1 and case == "routing":
            return b.dispatch(P.x[r], P.idx[r], handle=handle)
        if r == 1 and case == "layout":
            return b.dispatch(P.x[r], layout="rank_major", handle=handle)
        if r == 1 and case == "tokens":
            return b.dispatch(P.x[r][:5], handle=handle)
        return b.dispatch(P.x[r], handle=handle if r == 1 else d.handle)

    _, errors = run_ranks(groups, rank)
    assert isinstance(errors[1], epx.InvalidArgument), errors[1]
    assert isinstance(errors[0], epx.PeerFailed), errors[0]
    words = {"routing": "takes the routing of the handle's dispatch", "layout": "has its handle's layout",
             "tokens": "the handle's dispatch had 12", "other buffer": "made by another buffer"}[case]
    assert words in str(errors[1]) and words in str(errors[0])
