"""epx.dispatch_all and the others (python/epx/all_ranks.py) on the CPU backend: one thread's calls
for every rank equal, bit for bit, one thread per rank's; a rank's bad input raises its own error
and the next call works; the refusals."""

import pytest
import torch

import epx
from helpers import TIMEOUT_MS, Problem, make_buffers, run_all

RANKS, H, E, K = 3, 64, 6, 2


def problem():
    return Problem(RANKS, H, E, K, [7, 5, 6], seed=41, unused=0.1)


def buffers_for(groups, **kw):
    return make_buffers(groups, hidden=H, max_tokens_per_rank=8, num_experts=E, topk=K, **kw)


def test_dispatch_and_combine_from_one_thread_equal_one_thread_per_rank():
    p = problem()
    one, each = buffers_for(epx.Group.host(RANKS)), buffers_for(epx.Group.host(RANKS))
    inputs = [dict(x=p.x[r], topk_idx=p.idx[r], topk_weights=p.w[r]) for r in range(RANKS)]
    outs = epx.dispatch_all(one, inputs, layout="expert_major")
    ys = [torch.randn(o.recv_x.shape, generator=torch.Generator().manual_seed(50 + r)).bfloat16()
          for r, o in enumerate(outs)]
    combined = epx.combine_all(one, ys, [o.handle for o in outs])

    def rank(g):
        b, r = each[g.rank], g.rank
        d = b.dispatch(p.x[r], p.idx[r], p.w[r], layout="expert_major")
        return d, b.combine(ys[r], d.handle)

    for r, (d, c) in enumerate(run_all([b.group for b in each], rank)):
        assert torch.equal(outs[r].recv_x, d.recv_x) and torch.equal(outs[r].expert_offsets, d.expert_offsets)
        assert torch.equal(combined[r].out, c.out)


def test_low_latency_from_one_thread():
    p = problem()
    groups = epx.Group.host(RANKS)
    buffers = run_all(groups, lambda g: epx.LowLatencyBuffer(g, H, 8, E, K, timeout_ms=TIMEOUT_MS))
    inputs = [dict(x=p.x[r], topk_idx=p.idx[r], topk_weights=p.w[r]) for r in range(RANKS)]
    outs = epx.ll_dispatch_all(buffers, inputs)
    ys = [torch.randn(o.recv_x.shape, generator=torch.Generator().manual_seed(60 + r)).bfloat16()
          for r, o in enumerate(outs)]
    combined = epx.ll_combine_all(buffers, ys, [o.handle for o in outs])
    assert [tuple(c.shape) for c in combined] == [(t, H) for t in p.tokens]
    assert all(int(o.recv_count.sum()) > 0 for o in outs)


def test_a_bad_input_raises_its_ranks_own_error_and_the_next_call_works():
    p = problem()
    buffers = buffers_for(epx.Group.host(RANKS))
    inputs = [dict(x=p.x[r], topk_idx=p.idx[r], topk_weights=p.w[r]) for r in range(RANKS)]
    bad = list(inputs)
    bad[1] = dict(inputs[1], topk_idx=torch.full_like(p.idx[1], E + 3))
    with pytest.raises(epx.InvalidArgument, match=str(E + 3)):
        epx.dispatch_all(buffers, bad)
    assert len(epx.dispatch_all(buffers, inputs)) == RANKS


def test_refusals():
    p = problem()
    buffers = buffers_for(epx.Group.host(RANKS))
    inputs = [dict(x=p.x[r], topk_idx=p.idx[r], topk_weights=p.w[r]) for r in range(RANKS)]
    with pytest.raises(epx.InvalidArgument, match="2 inputs for 3 buffers"):
        epx.dispatch_all(buffers, inputs[:2])
    with pytest.raises(epx.InvalidArgument, match="is rank 1 again"):
        epx.dispatch_all([buffers[0], buffers[1], buffers[1]], inputs)
    with pytest.raises(epx.InvalidArgument, match="no buffers"):
        epx.dispatch_all([], [])
    assert len(epx.dispatch_all(buffers, inputs)) == RANKS  # nothing ran: the ranks are in step
