"""Lifetimes: outputs are torch tensors over epx's memory, without copies, valid as long as they
are held (also after their buffer is gone); the handle lives in its token."""

import gc
import weakref

import pytest
import torch

import epx
from helpers import Problem, make_buffers, run_all

P = Problem(2, 64, 4, 2, 8, seed=19)


def dispatch_on_fresh_buffers():
    """Every rank's dispatch output, and weak references to the buffers (gone when this returns)."""
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)
    runs = run_all(groups, lambda g: buffers[g.rank].dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank]))
    return runs, [weakref.ref(b) for b in buffers]


def test_outputs_outlive_their_buffer():
    runs, buffers = dispatch_on_fresh_buffers()
    gc.collect()
    assert all(b() is None for b in buffers)
    copies = [d.recv_x.clone() for d in runs]
    runs = [d._replace(recv_src=d.recv_src + 0) for d in runs]  # use them again after the buffers went
    for d, copy in zip(runs, copies):
        assert torch.equal(d.recv_x, copy)
        assert d.handle.num_rows == d.recv_x.shape[0]


def test_close_and_later_calls():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)
    runs = run_all(groups, lambda g: buffers[g.rank].dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank]))
    for b in buffers:
        b.close()
    assert runs[0].recv_x.shape[1] == 64
    with pytest.raises(epx.InvalidArgument, match="closed"):
        buffers[0].dispatch(P.x[0], P.idx[0], P.w[0])


def test_outputs_are_views_of_epx_memory_and_the_token_keeps_the_handle():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2)

    def rank(g):
        b = buffers[g.rank]
        d = b.dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank])
        first = d.recv_x.data_ptr()
        handle, y = d.handle, d.recv_x
        del d
        gc.collect()
        again = b.dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank])  # a new call does not touch held outputs
        return first == y.data_ptr(), b.combine(y, handle).out, b.combine(again.recv_x, again.handle).out

    for same, out, out_again in run_all(groups, rank):
        assert same
        assert torch.equal(out, out_again)


def test_handle_token_form():
    groups = epx.Group.host(2)
    buffers = make_buffers(groups, hidden=64, max_tokens_per_rank=8, num_experts=4, topk=2, capacity_factor=0.5)
    for d in run_all(groups, lambda g: buffers[g.rank].dispatch(P.x[g.rank], P.idx[g.rank], P.w[g.rank])):
        token = d.handle.token
        assert token.dtype == torch.int64 and token.shape == (4,) and token.device.type == "cpu"
        assert token[1] == d.num_rows and token[2] == int(d.overflow) and token[3] == d.dropped_slots
